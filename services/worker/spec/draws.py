"""The random numbers of speculative decoding, all from the sampler's counter RNG.

Every draw is keyed by (seed, position, token id) (CONTRACTS.md "Gumbel-max sampling"), so a
request's drafts, acceptances and corrections do not depend on what else is in the batch. Three
uses share one seed and must stay independent, so each has its own position range:

- the target's draws (plain decoding, the bonus token, the residual draw after a rejection):
  position p itself;
- drafts: p + DRAFT_POSITION_SALT (2^30), as the contract says;
- the uniform that accepts or rejects a sampled draft: p + ACCEPT_POSITION_SALT (2^31), keyed
  by the draft's token id.

Positions stay below 2^30 (no model has that context), so the ranges never meet.
"""

from __future__ import annotations

import torch

from meshllm_kernels.sampling.gumbel import gumbel_argmax
from meshllm_kernels.sampling.murmur3 import uniform32

DRAFT_POSITION_SALT = 1 << 30
ACCEPT_POSITION_SALT = 1 << 31


def gumbel_draw(
    scores: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row: argmax(scores · inv_T + g(seed, position, token)), int64 [B].

    Per-row tensors ([B] each, on the scores' device); inv_T 0 is a plain argmax. The Triton
    kernel on CUDA (no host sync), its PyTorch reference elsewhere: the same tokens."""
    if scores.is_cuda:
        from meshllm_kernels.sampling.gumbel_kernel import gumbel_argmax_triton

        return gumbel_argmax_triton(
            scores.contiguous(),
            inv_temperature.to(torch.float32).contiguous(),
            seeds.to(torch.int64).contiguous(),
            positions.to(torch.int64).contiguous(),
        )
    return gumbel_argmax(scores, inv_temperature, seeds, positions)


def accept_uniforms(
    seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """float32 uniforms in (0, 1) that accept or reject draft `token_ids` at `positions`."""
    return uniform32(seeds, positions + ACCEPT_POSITION_SALT, token_ids)
