"""Logprobs returned with sampled tokens: from the model's own distribution.

As vLLM's default `logprobs_mode="raw_logprobs"`, they are log_softmax of the logits the model
produced — after the grammar bitmask (vLLM applies it in the model runner, before its sampler),
before penalties, bias, banned/allowed ids, temperature and truncation. So a logprob answers
"how likely did the model find this token", not "how likely was this draw", and does not change
with sampling parameters.
"""

from __future__ import annotations

import torch


def model_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax over the vocabulary, [B, V]."""
    return torch.log_softmax(logits.float(), dim=-1)


def pick_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of sampled [B], top-k ids int64 [B, k], top-k logprobs [B, k]).

    Top entries come in descending logprob order; k = 0 gives [B, 0] tensors.
    """
    chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    k = min(k, logprobs.shape[1])
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        return chosen, top.indices, top.values
    empty = logprobs.new_empty(logprobs.shape[0], 0)
    return chosen, empty.to(torch.int64), empty
