"""The strided split-K decode's pieces: the tile walk of one piece and its finish (partial
store, then the merge by the last piece to finish). Shared by the decode kernel that reads
rotated queries (meshllm_kernels/attention/paged_decode.py) and the one that builds them from the
qkv projection's split-K partials (meshllm_kernels/decode_chain/decode_from_qkv.py), so both fold
the same tiles in the same order and round the same way.

A piece takes every NUM_SPLITS-th tile: tile t (keys [t * BLOCK_N, (t + 1) * BLOCK_N)) belongs
to piece t % NUM_SPLITS. Its first tile's block ids are known before the sequence length, so
they load together with it, and each further tile's ids load one tile ahead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from meshllm_kernels.attention.tile_step import attend_tile_ids


@triton.jit
def first_tile_ids(table, split, max_blocks, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ids [BLOCK_N] of piece `split`'s first tile (no dependency on seq_len)."""
    blk = (split * BLOCK_N + tl.arange(0, BLOCK_N)) // PAGE
    return tl.load(table + blk, mask=blk < max_blocks, other=0)


@triton.jit
def walk_piece(
    q, ids, table, max_blocks, seq_len, split, kv_head, offs_g, qk_scale, cache_ptr,
    stride_kv, stride_block, stride_slot, stride_head,
    BLOCK_G: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    """Fold piece `split`'s tiles of [0, seq_len) into a fresh online softmax; `ids` are its
    first tile's block ids (first_tile_ids). Returns (acc [BLOCK_G, BLOCK_D], l_i, m_i)."""
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    full_tiles = seq_len // BLOCK_N
    for t in range(split, full_tiles, NUM_SPLITS):
        blk = ((t + NUM_SPLITS) * BLOCK_N + tl.arange(0, BLOCK_N)) // PAGE
        next_ids = tl.load(table + blk, mask=blk < max_blocks, other=0)
        acc, l_i, m_i = attend_tile_ids(
            acc, l_i, m_i, q, cache_ptr, ids, t * BLOCK_N, seq_len, kv_head, offs_g, 0,
            qk_scale, stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM,
            BLOCK_D, BLOCK_N, False, False, False, FP32_DOT,
        )  # fmt: skip
        ids = next_ids
    # The sequence's last, partial tile (number full_tiles), if this piece owns it: `ids` now
    # holds the block ids of the piece's first tile at or past full_tiles.
    last = split + tl.cdiv(tl.maximum(full_tiles - split, 0), NUM_SPLITS) * NUM_SPLITS
    if (last == full_tiles) & (full_tiles * BLOCK_N < seq_len):
        acc, l_i, m_i = attend_tile_ids(
            acc, l_i, m_i, q, cache_ptr, ids, last * BLOCK_N, seq_len, kv_head, offs_g, 0,
            qk_scale, stride_kv, stride_block, stride_slot, stride_head, PAGE, HEAD_DIM,
            BLOCK_D, BLOCK_N, True, False, False, FP32_DOT,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def store_piece(part_out_ptr, part_lse_ptr, out, l_i, m_i, row, offs_d, out_mask, g_valid,
                HEAD_DIM: tl.constexpr):  # fmt: skip
    """A piece's partial output (normalized by its own sum) and log-sum-exp (log2 domain;
    -inf for a piece without keys). Partials are contiguous [B, Hq, NUM_SPLITS, HEAD_DIM] and
    lse [B, Hq, NUM_SPLITS]; `row` = (seq * Hq + head) * NUM_SPLITS + split."""
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + row, lse, mask=g_valid)


@triton.jit
def finish_piece(
    acc, l_i, m_i, v_scale, seq, kv_head, split, heads, g_valid, d_valid, offs_d,
    out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, FUSED_MERGE: tl.constexpr,
    MERGE_G: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Store the piece's partials; FUSED_MERGE: the last piece of each (sequence, kv head) to
    finish merges its GROUP heads' pieces (one load of all of them) into out and resets its
    counter, instead of a second kernel."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    row = (seq.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
    store_piece(part_out_ptr, part_lse_ptr, out, l_i, m_i, row, offs_d,
                g_valid[:, None] & d_valid[None, :], g_valid, HEAD_DIM)  # fmt: skip
    if FUSED_MERGE:
        # Every thread's partial stores come before the release of the count; the merger
        # reads the pieces from L2 (".cg": other programs wrote them, on other SMs).
        tl.debug_barrier()
        counter = counter_ptr + seq * NUM_KV_HEADS + kv_head
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == NUM_SPLITS - 1:
            offs_m = tl.arange(0, MERGE_G)
            offs_s = tl.arange(0, BLOCK_S)
            m_valid = offs_m < GROUP
            s_valid = offs_s < NUM_SPLITS
            rows = (seq.to(tl.int64) * NUM_HEADS + kv_head * GROUP + offs_m)[:, None] * (
                NUM_SPLITS
            ) + offs_s[None, :]  # [MERGE_G, BLOCK_S]
            valid = m_valid[:, None] & s_valid[None, :]
            lse_all = tl.load(
                part_lse_ptr + rows, mask=valid, other=float("-inf"), cache_modifier=".cg"
            )
            parts = tl.load(
                part_out_ptr + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                mask=valid[:, :, None] & d_valid[None, None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            m = tl.max(lse_all, 1)
            m = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp2(lse_all - m[:, None])
            total = tl.sum(w, 1)
            w = w / tl.where(total > 0.0, total, 1.0)[:, None]
            merged = tl.sum(parts * w[:, :, None], 1)  # [MERGE_G, BLOCK_D]
            out_heads = kv_head * GROUP + offs_m
            tl.store(
                out_ptr + seq.to(tl.int64) * stride_ob + out_heads[:, None] * stride_oh
                + offs_d[None, :],
                merged.to(out_ptr.dtype.element_ty),
                mask=m_valid[:, None] & d_valid[None, :],
            )  # fmt: skip
            tl.atomic_xchg(counter, 0)  # ready for the next launch (CUDA graph replays)
