"""Prompt logprobs: for every prompt token after the first, its logprob given the tokens before
it (and the top-k alternatives), for requests whose SamplingParams.prompt_logprobs asks.

The forward already computes the hidden state of every prompt position; the LM head runs over
those of asking requests (in slices, so a long prompt's [positions, vocab] logits stay small),
and position p gives the logprob of prompt token p + 1. Positions are kept until the request's
next sampled token, whose SampledTokens carries them (a prefill chunk that samples nothing
returns nothing, as with routed experts): the first sampled token carries them all.

Each entry is placed by position (`prompt_logprobs_start`), so a recompute (preemption, a
failed step) that computes the same positions again gives the same reply. Such a request never
takes a prefix-cache hit (KVCacheManager.get_computed_blocks): a cached position is never
computed, so it would have no logprob.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.protocol import SampledTokens, StepPlan

#: Prompt positions per LM-head call: [rows, vocab] fp32 logits (128 MiB at a 128k vocabulary).
ROWS_PER_SLICE = 256


@dataclass
class _Asking:
    k: int  # top alternatives per token
    prompt: np.ndarray  # the prompt's token ids
    start: int = 0  # position of the first pending entry
    logprobs: list[np.ndarray] = field(default_factory=list)  # pending, in position order
    ranks: list[np.ndarray] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_logprobs: list[np.ndarray] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + sum(len(x) for x in self.logprobs)

    def restart(self, start: int) -> None:
        self.start, self.logprobs, self.ranks = start, [], []
        self.top_ids, self.top_logprobs = [], []


class PromptLogprobsTracker:
    def __init__(self) -> None:
        self.wanted: dict[str, _Asking] = {}

    def apply(self, plan: StepPlan) -> None:
        """Follow the plan's diff: requests leaving the batch drop what they held; new ones
        (also a resumed request, which recomputes from its num_computed_tokens) start afresh."""
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self.wanted.pop(request_id, None)
        for new in plan.new_requests:
            self.wanted.pop(new.request_id, None)
            k = new.sampling.prompt_logprobs
            if k is not None:
                prompt = np.asarray(new.token_ids[: new.num_prompt_tokens], dtype=np.int64)
                self.wanted[new.request_id] = _Asking(k, prompt)

    def collect(
        self,
        hidden: torch.Tensor,
        request_ids: list[str],
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """After the forward: the logprobs of the prompt positions this step computed for each
        asking request (`hidden` in flat-batch order)."""
        ends = np.cumsum(query_lens)
        for i, request_id in enumerate(request_ids):
            asking = self.wanted.get(request_id)
            if asking is None:
                continue
            first = int(seq_lens[i] - query_lens[i])  # position of the step's first token
            last = min(int(seq_lens[i]), len(asking.prompt) - 1)  # positions with a prompt target
            if first >= last:
                continue
            row0 = int(ends[i] - query_lens[i])
            rows = hidden[row0 : row0 + last - first]
            targets = torch.from_numpy(asking.prompt[first + 1 : last + 1]).to(hidden.device)
            self._add(asking, first, rows, targets, compute_logits)

    def _add(
        self,
        asking: _Asking,
        first: int,
        rows: torch.Tensor,
        targets: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        if not asking.logprobs or first != asking.end:
            asking.restart(first)  # nothing held, or not contiguous with it (a recompute)
        for lo in range(0, rows.shape[0], ROWS_PER_SLICE):
            logits = compute_logits(rows[lo : lo + ROWS_PER_SLICE]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            own = logprobs.gather(1, targets[lo : lo + ROWS_PER_SLICE, None]).squeeze(1)
            asking.logprobs.append(own.cpu().numpy())
            # vLLM's rank: the tokens at least as likely as the prompt's (itself included).
            rank = (logprobs >= own[:, None]).sum(dim=-1)
            asking.ranks.append(rank.to(torch.int32).cpu().numpy())
            if asking.k:
                top = torch.topk(logprobs, asking.k, dim=-1)
                asking.top_ids.append(top.indices.to(torch.int32).cpu().numpy())
                asking.top_logprobs.append(top.values.cpu().numpy())

    def attach(self, sampled: list[SampledTokens]) -> list[SampledTokens]:
        """Give each sampled token's SampledTokens the prompt logprobs its request holds."""
        out = []
        for tokens in sampled:
            asking = self.wanted.get(tokens.request_id)
            if asking is None or not asking.logprobs:
                out.append(tokens)
                continue
            fields: dict[str, object] = {
                "prompt_logprobs_start": asking.start,
                "prompt_logprobs": np.concatenate(asking.logprobs).tolist(),
                "prompt_ranks": np.concatenate(asking.ranks).tolist(),
            }
            if asking.k:
                fields["prompt_top_token_ids"] = np.concatenate(asking.top_ids).ravel().tolist()
                fields["prompt_top_logprobs"] = np.concatenate(asking.top_logprobs).ravel().tolist()
            asking.restart(asking.end)
            out.append(tokens.model_copy(update=fields))
        return out

    def clear(self) -> None:
        self.wanted.clear()
