"""The paged prefill kernel's specializations a server meets, compiled before it serves.

paged_prefill_attention runs the prefill spans that continue a cached prefix: a prompt's
second chunk, a prefix-cache hit, a resumed request (a fresh prompt goes through dense flash
attention, so a warm-up prefill never launches it). Its tiles are fixed; what varies is the
block table's width (its row stride, which Triton specializes by whether it is 1 or a
multiple of 16): the eager steps upload a multiple of 16 columns or the whole capacity
(services/worker/attention/table_width.py). `compile_prefill_variants` launches the kernel at
each width on one query of one key, so the first such span of a server does not wait for
a compile.
"""

from __future__ import annotations

import time

import torch

from meshllm_kernels.attention.paged_prefill import paged_prefill_attention


def compile_prefill_variants(
    kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype, table_widths: set[int]
) -> float:
    """Launch the causal kernel at every table width on one sequence of one token (reads block
    0 of `kv_cache`, writes nothing into it); returns the seconds taken. `dtype` is the
    queries' (the model's)."""
    started = time.perf_counter()
    device = kv_cache.device
    q = torch.zeros(1, num_heads, kv_cache.shape[-1], dtype=dtype, device=device)
    cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    for width in sorted(table_widths):
        tables = torch.zeros(1, width, dtype=torch.int32, device=device)
        paged_prefill_attention(
            q, kv_cache, tables, cu_seqlens_q, seq_lens, causal=True, max_seqlen_q=1
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
