"""Paged attention for prefill/extend over variable-length sequences, and its reference.

Queries are flat [T, Hq, D]; sequence i owns rows cu_seqlens_q[i] .. cu_seqlens_q[i+1] and
its keys are the first seq_lens[i] slots of its block table: the committed context followed by
the new tokens, which kv_insert has already written. So query row j of a sequence with qlen
new tokens sits at position ctx_len + j, where ctx_len = seq_len - qlen.

Masking (one `causal` flag per launch: causality is chosen per micro-batch):
- causal: position p sees keys <= p;
- non-causal (draft blocks): every query of the block sees the whole sequence, i.e. the
  committed prefix plus all of its own block;
- sliding window W: additionally only keys > p - W (W keys including its own position).
  In a non-causal block the window's lower edge stays at each query's own position.

Decode (one query per sequence, split-K over long contexts) is in
meshllm_kernels.attention.paged_decode and is re-exported here. Softmax runs online in fp32 (log2
domain); fp8 e4m3 caches are dequantized on load with per-tensor or per-kv-head scales folded into
the scores (K) and the output (V).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from meshllm_kernels.attention.paged_cache import (
    check_block_tables,
    check_kv_cache,
    check_seq_lens,
    check_window,
    fp8_scales,
    gather_sequence_kv,
)
from meshllm_kernels.attention.paged_decode import paged_decode_attention, paged_decode_reference
from meshllm_kernels.attention.tile_step import AttentionTiles, attend_tile
from meshllm_kernels.runtime.tensor_checks import (
    MODEL_DTYPES,
    check_tensor,
    interpreting,
    next_power_of_2,
)

__all__ = [
    "paged_decode_attention",
    "paged_decode_reference",
    "paged_prefill_attention",
    "paged_prefill_reference",
]

LOG2E = 1.4426950408889634
# Small tiles under the interpreter exercise the multi-tile paths on small test sequences.
INTERPRETER_TILES = AttentionTiles(block_m=16, block_n=16)
PREFILL_TILES = AttentionTiles(block_m=64, block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _prefill_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sm_scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    stride_bt,
    k_scale_stride,
    v_scale_stride,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    pos_m = ctx_len + offs_m
    pos_first = ctx_len + m_tile * BLOCK_M
    pos_last = ctx_len + tl.minimum((m_tile + 1) * BLOCK_M, q_len) - 1

    k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride)
    v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride)
    qk_scale = sm_scale_log2 * k_scale

    # Key ranges: [lo, mid_lo) and [mid_hi, hi) need masks (window edge, causal diagonal,
    # sequence end); in [mid_lo, mid_hi) every valid query of the tile sees every key.
    if CAUSAL:
        hi = pos_last + 1
        mid_hi = ((pos_first + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = seq_len
        mid_hi = (seq_len // BLOCK_N) * BLOCK_N
    lo = 0
    mid_lo = 0
    if WINDOWED:
        lo = (tl.maximum(0, pos_first - window + 1) // BLOCK_N) * BLOCK_N
        mid_lo = tl.cdiv(tl.maximum(0, pos_last - window + 1), BLOCK_N) * BLOCK_N
    first_end = tl.minimum(mid_lo, hi)
    last_start = tl.maximum(mid_lo, mid_hi)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(lo, first_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, cache_ptr, table, start_n, hi, kv_head, pos_m, window, qk_scale,
            stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM, BLOCK_D,
            BLOCK_N, True, CAUSAL, WINDOWED, FP32_DOT,
        )  # fmt: skip
    for start_n in range(mid_lo, mid_hi, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, cache_ptr, table, start_n, hi, kv_head, pos_m, window, qk_scale,
            stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM, BLOCK_D,
            BLOCK_N, False, CAUSAL, WINDOWED, FP32_DOT,
        )  # fmt: skip
    for start_n in range(last_start, hi, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, cache_ptr, table, start_n, hi, kv_head, pos_m, window, qk_scale,
            stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM, BLOCK_D,
            BLOCK_N, True, CAUSAL, WINDOWED, FP32_DOT,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


def _check_lengths(
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, capacity: int
) -> int:
    """Host-side consistency of the length tensors; returns the longest query run."""
    cu = cu_seqlens_q.cpu().long()
    lens = seq_lens.cpu().long()
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens_q must start at 0 and end at the token count {num_tokens}, "
            f"got {int(cu[0])} .. {int(cu[-1])}"
        )
    if bool((q_lens < 0).any()):
        raise ValueError("cu_seqlens_q must be non-decreasing")
    if bool((lens < q_lens).any()):
        raise ValueError("each seq_len must count its new query tokens (seq_len >= qlen)")
    if bool((lens > capacity).any()):
        raise ValueError(f"a seq_len exceeds the block table's capacity of {capacity} slots")
    return int(q_lens.max()) if q_lens.numel() else 0


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:
    """Attention of flat queries [T, Hq, D] over their paged sequences; returns [T, Hq, D].

    Pass `max_seqlen_q` to launch without a host sync (e.g. inside a CUDA graph); without it
    the length tensors are read back once and checked for consistency.
    """
    q = check_tensor("q", q, dtypes=MODEL_DTYPES, ndim=3, last_dim_contiguous=True)
    device = q.device
    geo = check_kv_cache(kv_cache, device)
    num_tokens, num_heads, head_dim = q.shape
    if head_dim != geo.head_dim:
        raise ValueError(f"q head_dim {head_dim} != kv_cache head_dim {geo.head_dim}")
    if num_heads % geo.num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of kv heads ({geo.num_kv_heads})"
        )
    cu = check_tensor(
        "cu_seqlens_q",
        cu_seqlens_q,
        dtypes=(torch.int32,),
        ndim=1,
        device=device,
        contiguous=True,
    )
    if cu.shape[0] < 1:
        raise ValueError("cu_seqlens_q needs num_seqs + 1 entries")
    num_seqs = cu.shape[0] - 1
    lens = check_seq_lens(seq_lens, num_seqs, device)
    tables = check_block_tables(block_tables, num_seqs, device)
    window = check_window(sliding_window)
    ks, ks_stride, vs, vs_stride = fp8_scales(geo, k_scale, v_scale, device)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, dtypes=(q.dtype,), device=device, last_dim_contiguous=True)
        if out.shape != q.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {tuple(q.shape)}")
    if max_seqlen_q is None or device.type == "cpu":
        longest = _check_lengths(cu, lens, num_tokens, tables.shape[1] * geo.block_size)
        max_seqlen_q = longest if max_seqlen_q is None else max_seqlen_q
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out

    fp32_dot = interpreting() or q.dtype == torch.float32
    tiles = tiles or (INTERPRETER_TILES if interpreting() else PREFILL_TILES)
    tiles.check()
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    grid = (num_seqs, triton.cdiv(max_seqlen_q, tiles.block_m), num_heads)
    _prefill_kernel[grid](
        q, out, kv_cache, tables, cu, lens, ks, vs,
        scale * LOG2E, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        tables.stride(0), ks_stride, vs_stride,
        PAGE=geo.block_size, GROUP=num_heads // geo.num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, CAUSAL=bool(causal), WINDOWED=window > 0, FP32_DOT=fp32_dot,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def attention_mask(
    q_len: int, seq_len: int, *, causal: bool, sliding_window: int | None
) -> torch.Tensor:
    """[q_len, seq_len] bool: which keys each new query of a sequence may see."""
    positions = torch.arange(seq_len - q_len, seq_len)[:, None]
    keys = torch.arange(seq_len)[None, :]
    mask = keys <= positions if causal else torch.ones(q_len, seq_len, dtype=torch.bool)
    if sliding_window:
        mask = mask & (keys > positions - sliding_window)
    return mask


def paged_prefill_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in plain PyTorch (fp32 math, one sequence at a time)."""
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // kv_cache.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    cu = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        k, v = gather_sequence_kv(kv_cache, block_tables[i], seq_len, k_scale, v_scale)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        mask = attention_mask(
            end - start, seq_len, causal=causal, sliding_window=sliding_window
        ).to(q.device)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
