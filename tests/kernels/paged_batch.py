"""Random paged batches for the attention tests: scattered physical blocks, real layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshllm_kernels.runtime.tensor_checks import FP8_E4M3, FP8_E4M3_MAX, interpreting


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D] (prefill) or [B, Hq, D] (decode)
    kv_cache: torch.Tensor  # [2, num_blocks, page, Hkv, D]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict[str, torch.Tensor]:
        if self.k_scale is None:
            return {}
        assert self.v_scale is not None
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    device: torch.device,
    cache_dtype: torch.dtype | None = None,
    per_head_scale: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """Sequences with seq_lens keys each, of which the last q_lens are new queries.

    Physical blocks are a random permutation (no two sequences share one, none contiguous by
    accident), unused table entries point at block 0. fp8 caches hold values quantized from
    fp32 with random positive scales, like a real fp8 writer.
    """
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    blocks_per_seq = [(s + page - 1) // page for s in seq_lens]
    max_blocks = max(1, *blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    raw = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=gen)
    k_scale = v_scale = None
    if cache_dtype == FP8_E4M3:
        shape = (num_kv_heads,) if per_head_scale else (1,)
        k_scale = torch.rand(shape, generator=gen) * 0.02 + 0.005
        v_scale = torch.rand(shape, generator=gen) * 0.02 + 0.005
        ks = k_scale.reshape(1, 1, 1, -1, 1)
        vs = v_scale.reshape(1, 1, 1, -1, 1)
        k = (raw[0:1] / ks).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        v = (raw[1:2] / vs).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        cache = torch.cat([k, v]).to(FP8_E4M3)
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    else:
        cache = raw.to(cache_dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device),
        kv_cache=cache.to(device),
        block_tables=tables.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance for attention outputs of magnitude ~1 rounded to `dtype`."""
    return {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype] * (
        2 if interpreting() else 1
    )
