"""One online-softmax step over a tile of paged keys: the inner loop of prefill and decode.

Both attention kernels walk a sequence's keys BLOCK_N at a time, gathering K and V rows
through the block table, and fold each tile into a running (max, sum, accumulator) in fp32,
log2 domain. Most tiles need no masking at all (every query of the program sees every key of
the tile), so the masks are constexpr switches: the unmasked steps load without predicates
and skip the `where`, and only the tiles at the window's lower edge, the causal diagonal and
the sequence end pay for masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionTiles:
    """Launch shape of an attention kernel (prefill uses block_m; decode its group padding)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def check(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"AttentionTiles.{name} must be a power of two >= 16, got {v}")


@triton.jit
def attend_tile(
    acc,
    l_i,
    m_i,
    q,
    cache_ptr,
    table_ptr,
    start_n,
    hi,
    kv_head,
    pos_m,
    window,
    qk_scale,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """Fold keys [start_n, start_n + BLOCK_N) (those < hi when MASKED) into (acc, l_i, m_i).

    q is [ROWS, BLOCK_D]; pos_m [ROWS] the query positions (read only when MASKED with
    CAUSAL or WINDOWED). Returns the updated (acc, l_i, m_i).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        block_ids = tl.load(table_ptr + offs_n // PAGE, mask=offs_n < hi, other=0)
    else:
        block_ids = tl.load(table_ptr + offs_n // PAGE)
    return attend_tile_ids(
        acc, l_i, m_i, q, cache_ptr, block_ids, start_n, hi, kv_head, pos_m, window, qk_scale,
        stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM, BLOCK_D, BLOCK_N,
        MASKED, CAUSAL, WINDOWED, FP32_DOT,
    )  # fmt: skip


@triton.jit
def attend_tile_ids(
    acc,
    l_i,
    m_i,
    q,
    cache_ptr,
    block_ids,
    start_n,
    hi,
    kv_head,
    pos_m,
    window,
    qk_scale,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """attend_tile once the tile's physical block ids [BLOCK_N] (one per key) are loaded: the
    decode kernel that deals tiles to pieces loads them early (before the sequence length is
    known, or one tile ahead)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < hi
    rows = block_ids.to(tl.int64) * stride_block + (offs_n % PAGE) * stride_slot
    ptrs = cache_ptr + (rows + kv_head * stride_head)[:, None] + offs_d[None, :]
    if MASKED:
        kv_mask = n_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(ptrs, mask=kv_mask, other=0.0)
        v = tl.load(ptrs + stride_kv, mask=kv_mask, other=0.0)
    elif HEAD_DIM != BLOCK_D:
        d_mask = (offs_d < HEAD_DIM)[None, :]
        k = tl.load(ptrs, mask=d_mask, other=0.0)
        v = tl.load(ptrs + stride_kv, mask=d_mask, other=0.0)
    else:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_kv)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if MASKED:
        mask = n_valid[None, :]
        if CAUSAL:
            mask = mask & (offs_n[None, :] <= pos_m[:, None])
        if WINDOWED:
            mask = mask & (offs_n[None, :] > pos_m[:, None] - window)
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:  # noqa: SIM108 (constexpr branch: only one side is compiled)
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new
