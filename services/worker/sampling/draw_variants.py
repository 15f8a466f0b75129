"""The draw kernel's specializations a CUDA worker launches, compiled at its warm-up.

`SamplingState.sample` draws with meshllm_kernels/sampling/gumbel_kernel.py: always through
the state rows, with either the feed (the worker's newest token per row, asynchronous
scheduling) or a grammar bitmask or neither, over the LM head's logits (the model's dtype) or
an fp32 copy of them (truncation, logprobs, penalties, per-entry stages). Triton compiles each
combination at its first launch, so the first request with a grammar, a top_p or logprobs held
its whole step for a compile (~0.5 s on the H200). The warm-up launches each one once instead.
Batch sizes and the alignment of the rows and positions (views into one upload) make no
specialization of their own (the kernel's `do_not_specialize` lists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sampling.state import SamplingState


@dataclass(frozen=True)
class DrawVariant:
    """One specialization of the draw as `SamplingState.sample` launches it."""

    logits_dtype: torch.dtype
    feed: bool  # the kernel writes the feed itself (only without a bitmask)
    bitmask: bool


def draw_variants(model_dtype: torch.dtype) -> list[DrawVariant]:
    """Every combination `sample` can launch for a model computing logits in `model_dtype`."""
    dtypes = dict.fromkeys((model_dtype, torch.float32))  # in order, once each
    flags = ((True, False), (False, False), (False, True))  # (feed, bitmask)
    return [DrawVariant(d, feed, bitmask) for d in dtypes for feed, bitmask in flags]


def compile_draws(sampler: SamplingState, logits: torch.Tensor) -> int:
    """Launch the draw once per variant with tensors laid out as `sample` passes them:
    `logits` is an LM head output of the runner ([rows, vocab], its dtype and strides), the
    temperature and seed tables are the sampler's own columns (their strides are specialized
    on; the kernel only reads them), the rest scratch, so nothing of the sampler changes.
    Returns the number of variants launched."""
    from meshllm_kernels.sampling.gumbel_kernel import gumbel_argmax_triton

    batch, vocab = logits.shape
    device = logits.device
    inv_temperature, seeds = sampler.inv_temperature, sampler.seed
    rows = torch.arange(batch, dtype=torch.int64, device=device)
    positions = torch.arange(batch, dtype=torch.int64, device=device)
    feed = torch.zeros(sampler.max_num_reqs, dtype=torch.int64, device=device)
    words = -(-vocab // 32)
    bitmask = torch.full((batch, words), -1, dtype=torch.int32, device=device)
    variants = draw_variants(logits.dtype)
    for v in variants:
        work = logits
        if v.logits_dtype != logits.dtype:  # the staged copy: [batch + scratch row, vocab]
            work = torch.empty(batch + 1, vocab, dtype=v.logits_dtype, device=device)[:batch]
            work.copy_(logits)
        gumbel_argmax_triton(
            work,
            inv_temperature,
            seeds,
            positions,
            bitmask if v.bitmask else None,
            rows if v.bitmask else None,  # bitmask row i for batch row i, int64 as sample's
            rows=rows,
            feed=feed if v.feed else None,
        )
    return len(variants)
