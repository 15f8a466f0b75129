"""Paged decode attention: one query per sequence, split-K over long contexts.

Batch-1 decode of a 32k context has only num_kv_heads programs' worth of work per sequence if
each program walks the whole context, which leaves most of the GPU idle. So the key range
[lo, seq_len) is cut into `num_splits` pieces: each program handles one (sequence, kv head,
piece), all query heads of the kv head's group at once (the K/V tile is read once per group),
and writes a partial output normalized by its own softmax sum plus its log-sum-exp (log2
domain). A reduce kernel then weights the pieces by exp2(lse - max lse). With one split the
first kernel writes the output directly.

Pieces are computed from each sequence's own length at run time, so any num_splits is correct
for any mix of lengths (empty pieces carry lse = -inf and weigh nothing); num_splits only
changes speed. Window: the query at position seq_len - 1 sees keys > seq_len - 1 - W.

Many pieces without a window (batch 1-2 at long contexts) run the strided kernel instead: a
piece takes every num_splits-th tile, so its first tile's block ids load together with the
sequence length (one dependent memory round trip fewer before the first K/V tile), the K/V
tiles are double-buffered, and the last piece of each (sequence, kv head) to finish merges
the pieces itself (an atomic count), so there is no second launch where the merger's registers
allow it (`merge_counters`); elsewhere the reduce kernel merges them, after the pieces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from meshllm_kernels.attention.decode_pieces import (
    finish_piece,
    first_tile_ids,
    store_piece,
    walk_piece,
)
from meshllm_kernels.attention.paged_cache import (
    check_block_tables,
    check_kv_cache,
    check_seq_lens,
    check_window,
    fp8_scales,
    gather_sequence_kv,
)
from meshllm_kernels.attention.tile_step import AttentionTiles, attend_tile
from meshllm_kernels.runtime import completion_counters
from meshllm_kernels.runtime.tensor_checks import (
    MODEL_DTYPES,
    check_tensor,
    interpreting,
    next_power_of_2,
    sm_count,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256
INTERPRETER_TILES = AttentionTiles(block_n=16)
# Tiles measured on the H200 (graph time): split-K launches (small batches, long contexts) run
# best on 128-key tiles, single-pass ones (large batches) on 64-key tiles.
DECODE_TILES = AttentionTiles(block_n=128, num_warps=4, num_stages=2)
DECODE_TILES_SINGLE_PASS = AttentionTiles(block_n=64, num_warps=4, num_stages=2)
# Single pass over many programs (MANY_PROGRAMS (sequence, kv head) pairs: 128+ sequences at 8
# kv heads), 16-bit caches: 32-key tiles on 2 warps, the faster choice there on the Llama-3-8B
# shape at every context length measured; below that they lose to DECODE_TILES_SINGLE_PASS.
DECODE_TILES_MANY_PROGRAMS = AttentionTiles(block_n=32, num_warps=2, num_stages=2)
MANY_PROGRAMS = 1024
# Split-K without a window runs the strided kernel (pieces dealt tile by tile, first block ids
# loaded with seq_len, K/V double-buffered) with its pieces merged by the last one to finish,
# where the split count is at least STRIDED_MIN_SPLITS (the default choice gives that to
# batches of 1-2 at 8 kv heads from 4k keys on), or at any split count where there are few
# programs (`few_programs`: batch 1-2 at 8 kv heads, shorter contexts): there it beats the
# two-kernel split-K, with fewer pieces (batch 8 at 5 pieces) it loses to it. Tiles:
# STRIDED_TILE_BYTES of K per tile (64 keys of bf16 at head_dim 128, 128 of fp8).
STRIDED_MIN_SPLITS = 16
SHORT_KEYS_PER_SPLIT = 64  # few programs, short context: a piece per 64-key tile
STRIDED_TILE_BYTES = 16384
MERGE_COUNTERS = "decode-merge"  # completion_counters family of the fused merge


@triton.jit
def _group_query(
    q_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, offs_g, offs_d, sm_scale_log2,
    stride_qb, stride_qh, k_scale_stride, v_scale_stride,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    """The query rows of one kv head's group, [BLOCK_G, BLOCK_D] (padding rows zero), with
    their head numbers and masks, the logit scale (log2 domain, k scale folded in) and the v
    scale."""
    heads = kv_head * GROUP + offs_g
    g_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride)
    v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride)
    return q, heads, g_valid, d_valid, sm_scale_log2 * k_scale, v_scale


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sm_scale_log2,
    window,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    stride_bt,
    k_scale_stride,
    v_scale_stride,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(0, seq_len - window)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    q, heads, g_valid, d_valid, qk_scale, v_scale = _group_query(
        q_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, offs_g, offs_d, sm_scale_log2,
        stride_qb, stride_qh, k_scale_stride, v_scale_stride, GROUP, HEAD_DIM, FP32_DOT,
    )  # fmt: skip
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Whole tiles without masks, then at most one partial tile at the end of the piece.
    full_end = start + tl.maximum(0, (end - start) // BLOCK_N) * BLOCK_N
    for start_n in range(start, full_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, cache_ptr, table, start_n, end, kv_head, offs_g, window,
            qk_scale, stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM,
            BLOCK_D, BLOCK_N, False, False, False, FP32_DOT,
        )  # fmt: skip
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, cache_ptr, table, start_n, end, kv_head, offs_g, window,
            qk_scale, stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM,
            BLOCK_D, BLOCK_N, True, False, False, FP32_DOT,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    out_mask = g_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        row = (seq.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        store_piece(part_out_ptr, part_lse_ptr, out, l_i, m_i, row, offs_d, out_mask, g_valid,
                     HEAD_DIM)  # fmt: skip


@triton.jit
def _decode_strided_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    sm_scale_log2,
    max_blocks,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    stride_bt,
    k_scale_stride,
    v_scale_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Split-K decode without a window, pieces dealt tile by tile
    (meshllm_kernels/attention/decode_pieces.py): a piece's first block ids load together with
    seq_len and q (two dependent memory round trips before the first K/V tile instead of three).
    Same partials as _decode_partial_kernel; FUSED_MERGE: the last piece to finish merges them."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    ids = first_tile_ids(table, split, max_blocks, PAGE, BLOCK_N)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    q, heads, g_valid, d_valid, qk_scale, v_scale = _group_query(
        q_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, offs_g, offs_d, sm_scale_log2,
        stride_qb, stride_qh, k_scale_stride, v_scale_stride, GROUP, HEAD_DIM, FP32_DOT,
    )  # fmt: skip
    acc, l_i, m_i = walk_piece(
        q, ids, table, max_blocks, seq_len, split, kv_head, offs_g, qk_scale, cache_ptr,
        stride_kv, stride_block, stride_slot, stride_head,
        BLOCK_G, NUM_SPLITS, PAGE, HEAD_DIM, BLOCK_D, BLOCK_N, FP32_DOT,
    )  # fmt: skip
    finish_piece(
        acc, l_i, m_i, v_scale, seq, kv_head, split, heads, g_valid, d_valid, offs_d,
        out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, stride_ob, stride_oh,
        NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS, GROUP, HEAD_DIM, FUSED_MERGE, MERGE_G, BLOCK_S,
    )  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    d_valid = offs_d < HEAD_DIM
    base = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_valid, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    w = w / tl.where(total > 0.0, total, 1.0)
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough pieces for about two waves of programs, each piece at least 256 keys long.

    Pieces are whole tiles (the kernel rounds a piece up to BLOCK_N keys), so the count is then
    trimmed to the pieces that hold keys: at 32k keys, 33 pieces of 993 keys become 32 of 1024,
    and the empty 33rd program that would spill into a third wave is never launched."""
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = triton.cdiv(2 * num_sms, programs)
    by_length = triton.cdiv(max(1, max_seq_len), MIN_KEYS_PER_SPLIT)
    splits = max(1, min(by_occupancy, by_length, MAX_SPLITS))
    if splits < STRIDED_MIN_SPLITS and few_programs(num_seqs, num_kv_heads, num_sms):
        # Short contexts at batch 1-2: latency, not bandwidth, decides; the strided kernel
        # (chosen for few programs) with one 64-key piece each, up to 16, and its fused merge,
        # rather than a couple of long pieces and a second launch.
        return max(
            1, min(triton.cdiv(max(1, max_seq_len), SHORT_KEYS_PER_SPLIT), STRIDED_MIN_SPLITS)
        )
    tiles = triton.cdiv(max(1, max_seq_len), DECODE_TILES.block_n)
    return max(1, triton.cdiv(tiles, triton.cdiv(tiles, splits)))


def few_programs(num_seqs: int, num_kv_heads: int, num_sms: int) -> bool:
    """So few (sequence, kv head) pairs that even split 16 ways they fill about one wave
    (batch 1-2 at 8 kv heads on 132 SMs): the strided kernel's case at any split count."""
    return num_seqs * num_kv_heads * 8 <= num_sms


def strided_choice(num_seqs: int, num_kv_heads: int, num_splits: int, device: torch.device) -> bool:
    """Whether split-K without a window runs the strided kernel: at STRIDED_MIN_SPLITS pieces
    or more, or at any split count with few programs."""
    return strided_at(num_seqs, num_kv_heads, num_splits, sm_count(device))


def strided_at(num_seqs: int, num_kv_heads: int, num_splits: int, num_sms: int) -> bool:
    """strided_choice on a device of `num_sms` streaming multiprocessors."""
    return num_splits >= STRIDED_MIN_SPLITS or few_programs(num_seqs, num_kv_heads, num_sms)


def single_pass_tiles(num_seqs: int, num_kv_heads: int, cache_element_size: int) -> AttentionTiles:
    """Tiles of the single-pass kernel (no split-K): DECODE_TILES_MANY_PROGRAMS where there are
    MANY_PROGRAMS (sequence, kv head) programs or more over a 16-bit cache, else
    DECODE_TILES_SINGLE_PASS."""
    if cache_element_size == 2 and num_seqs * num_kv_heads >= MANY_PROGRAMS:
        return DECODE_TILES_MANY_PROGRAMS
    return DECODE_TILES_SINGLE_PASS


def strided_tiles(head_dim: int, cache_element_size: int) -> AttentionTiles:
    """The strided kernel's tiles: STRIDED_TILE_BYTES of K per tile (16..128 keys), 4 warps,
    3 stages (K and V double-buffered)."""
    keys = STRIDED_TILE_BYTES // (next_power_of_2(head_dim) * cache_element_size)
    return AttentionTiles(block_n=min(128, max(16, next_power_of_2(keys))), num_stages=3)


@dataclass(frozen=True)
class LaunchChoice:
    """What a decode launch runs besides its grid: the kernel (strided or not), its split
    count and tiles. Each distinct choice is a kernel specialization of its own, compiled the
    first time it is launched (decode_variants.py lists those serving can meet)."""

    num_splits: int
    strided: bool
    tiles: AttentionTiles


def launch_choice(
    num_seqs: int,
    num_kv_heads: int,
    num_splits: int,
    window: int,
    head_dim: int,
    cache_element_size: int,
    num_sms: int,
    *,
    strided: bool | None = None,
    tiles: AttentionTiles | None = None,
) -> LaunchChoice:
    """The kernel and tiles of a launch at `num_splits` pieces: the strided kernel at
    STRIDED_MIN_SPLITS pieces or with few programs (`strided` pins it), never with a window or
    one piece; tiles as `tiles` pins them, else the kernel's measured ones."""
    if strided is None:
        strided = strided_at(num_seqs, num_kv_heads, num_splits, num_sms)
    strided = strided and num_splits > 1 and window == 0
    if tiles is None:
        if interpreting():
            tiles = INTERPRETER_TILES
        elif strided:
            tiles = strided_tiles(head_dim, cache_element_size)
        elif num_splits > 1:
            tiles = DECODE_TILES
        else:
            tiles = single_pass_tiles(num_seqs, num_kv_heads, cache_element_size)
    return LaunchChoice(num_splits, strided, tiles)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    tiles: AttentionTiles | None = None,
    strided: bool | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, q [B, Hq, D], over its paged context.

    `num_splits` fixes the split-K factor (1 = single pass); otherwise it is chosen from
    `max_seq_len`, which is read back from seq_lens (a host sync) when not given.

    Split-K without a window runs the strided kernel where `strided_choice` says so (None), or
    as `strided` pins it (tests compare the two kernels on the same case): its pieces take
    every num_splits-th tile, so each piece's first block ids load together with the sequence
    length, and its K/V tiles are double-buffered. The last of its pieces of each (sequence,
    kv head) to finish merges them, instead of a second kernel, where the merger's registers
    allow (group * num_splits * head_dim <= 4096 per warp). It counts finished pieces in a
    per-device buffer that each merge leaves zeroed, so two such launches must not run
    concurrently on different streams of one device; the buffer is allocated by the first
    eager call, and a first use inside a CUDA graph capture falls back to the second kernel.
    """
    q = check_tensor("q", q, dtypes=MODEL_DTYPES, ndim=3, last_dim_contiguous=True)
    device = q.device
    geo = check_kv_cache(kv_cache, device)
    num_seqs, num_heads, head_dim = q.shape
    if head_dim != geo.head_dim:
        raise ValueError(f"q head_dim {head_dim} != kv_cache head_dim {geo.head_dim}")
    if num_heads % geo.num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of kv heads ({geo.num_kv_heads})"
        )
    lens = check_seq_lens(seq_lens, num_seqs, device)
    tables = check_block_tables(block_tables, num_seqs, device)
    window = check_window(sliding_window)
    ks, ks_stride, vs, vs_stride = fp8_scales(geo, k_scale, v_scale, device)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != device:
        raise ValueError("out must match q in shape, dtype and device")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    if device.type == "cpu" or (num_splits is None and max_seq_len is None):
        capacity = tables.shape[1] * geo.block_size
        longest = int(lens.max()) if num_seqs else 0
        if num_seqs and (int(lens.min()) < 0 or longest > capacity):
            raise ValueError(f"seq_lens must lie in 0..{capacity} (the block table's capacity)")
        max_seq_len = longest if max_seq_len is None else max_seq_len
    if num_seqs == 0:
        return out
    if num_splits is None:
        assert max_seq_len is not None  # read back above when neither was given
        span = min(max_seq_len, window) if window else max_seq_len
        num_splits = default_num_splits(num_seqs, geo.num_kv_heads, span, sm_count(device))
    choice = launch_choice(
        num_seqs, geo.num_kv_heads, num_splits, window, head_dim, kv_cache.element_size(),
        sm_count(device), strided=strided, tiles=tiles,
    )  # fmt: skip
    use_strided, tiles = choice.strided, choice.tiles
    tiles.check()
    group = num_heads // geo.num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    merge_g, block_s = max(2, next_power_of_2(group)), max(2, next_power_of_2(num_splits))
    counters = (
        merge_counters(num_seqs, geo.num_kv_heads, group, num_splits, head_dim, tiles, device)
        if use_strided
        else None
    )
    if num_splits > 1:
        part_out, part_lse = piece_buffers(num_seqs, num_heads, num_splits, head_dim, device)
    else:
        part_out = part_lse = out  # unused by the single-pass specialization
    fp32_dot = interpreting() or q.dtype == torch.float32
    if use_strided:
        _decode_strided_kernel[(num_seqs, geo.num_kv_heads, num_splits)](
            q, kv_cache, tables, lens, ks, vs, out, part_out, part_lse,
            lens if counters is None else counters, scale * LOG2E, tables.shape[1],
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            tables.stride(0), ks_stride, vs_stride,
            NUM_HEADS=num_heads, NUM_KV_HEADS=geo.num_kv_heads, NUM_SPLITS=num_splits,
            PAGE=geo.block_size, GROUP=group, BLOCK_G=max(16, next_power_of_2(group)),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=tiles.block_n, FP32_DOT=fp32_dot,
            FUSED_MERGE=counters is not None, MERGE_G=merge_g, BLOCK_S=block_s,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip
    else:
        _decode_partial_kernel[(num_seqs, geo.num_kv_heads, num_splits)](
            q, kv_cache, tables, lens, ks, vs, out, part_out, part_lse,
            scale * LOG2E, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            tables.stride(0), ks_stride, vs_stride,
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, PAGE=geo.block_size, GROUP=group,
            BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_N=tiles.block_n, WINDOWED=window > 0, FP32_DOT=fp32_dot,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip
    if num_splits > 1 and counters is None:
        merge_pieces(part_out, part_lse, out)
    return out


def piece_buffers(
    num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [B, Hq, splits, D] and log-sum-exps [B, Hq, splits] of split-K."""
    part_out = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
    )
    return part_out, torch.empty(
        num_seqs, num_heads, num_splits, dtype=torch.float32, device=device
    )


def merge_counters(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    num_splits: int,
    head_dim: int,
    tiles: AttentionTiles,
    device: torch.device,
) -> torch.Tensor | None:
    """The fused merge's counters, or None where the merger's registers do not allow it (it
    holds all its pieces at once: at most 128 fp32 registers a thread) or a graph capture
    would have to allocate them; None means: merge with `merge_pieces`."""
    merge_g, block_s = max(2, next_power_of_2(group)), max(2, next_power_of_2(num_splits))
    if merge_g * block_s * max(16, next_power_of_2(head_dim)) > 128 * 32 * tiles.num_warps:
        return None
    return completion_counters.counters(MERGE_COUNTERS, device, num_seqs * num_kv_heads)


def merge_pieces(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """The second kernel of split-K: out [B, Hq, D] = the pieces weighted by their lse."""
    num_seqs, num_heads, num_splits, head_dim = part_out.shape
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
        BLOCK_S=max(2, next_power_of_2(num_splits)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
    )  # fmt: skip


def paged_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in plain PyTorch: fp32 softmax over each sequence's visible keys."""
    out = torch.empty_like(q)
    group = q.shape[1] // kv_cache.shape[3]
    scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo = max(0, seq_len - sliding_window) if sliding_window else 0
        k, v = gather_sequence_kv(kv_cache, block_tables[i], seq_len, k_scale, v_scale)
        k = k[lo:].repeat_interleave(group, dim=1)
        v = v[lo:].repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,khd->hk", q[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("hk,khd->hd", probs, v).to(q.dtype)
    return out
