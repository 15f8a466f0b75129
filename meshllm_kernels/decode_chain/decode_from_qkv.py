"""Decode attention straight from the qkv projection's split-K partials: one launch where the
unfused step has three.

After the qkv GEMV, a decode layer's attention is, unfused: the split-K reduce of the GEMV
(meshllm_kernels/decode_chain/gemv.py), RoPE + KV insert (meshllm_kernels/attention/kv_insert.py),
then the strided split-K decode with its fused merge (meshllm_kernels/attention/paged_decode.py). At
batch 1 these are three short, latency-bound launches with a gap before each. Here one kernel does
all three:

- each (sequence, kv head, piece) program sums the fp32 partials of its group's query heads in
  the reduce kernel's order, rounds them to the model dtype as the reduce stores them, rotates
  them in fp32 as the insert does (neox or gpt-j; each product rounded before the add, as the
  insert is compiled without FMA contraction) and rounds them as the insert stores them;
- the piece that owns the tile of the new token (the sequence's last key) first writes that
  token's rotated K and its V into the cache (fp8: quantized as the insert quantizes), then
  synchronizes its threads, then walks its tiles (meshllm_kernels/attention/decode_pieces.py), so
  its own store is what it reads back; no other piece reads that tile;
- the pieces are stored and merged as in the strided decode kernel.

So the cache bytes, the queries and the attention output are bit-identical to the three
launches (tests/kernels/test_decode_from_qkv.py). Inside the decode step's PDL chain the
kernel loads its block ids, sequence length and RoPE row (staged before the step) before it
waits for the GEMV.

Scope: decode rows only (one new token per sequence), no sliding window, the strided kernel's
split counts (meshllm_kernels.attention.paged_decode.strided_choice), no qkv bias or q/k norm; the
worker checks that (services/worker/accel/decode_chain.py) and keeps the three launches otherwise.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from meshllm_kernels.attention.decode_pieces import finish_piece, first_tile_ids, walk_piece
from meshllm_kernels.attention.kv_insert import to_cache
from meshllm_kernels.attention.paged_cache import (
    check_block_tables,
    check_kv_cache,
    check_seq_lens,
    fp8_scales,
)
from meshllm_kernels.attention.paged_decode import (
    INTERPRETER_TILES,
    LOG2E,
    MAX_SPLITS,
    merge_counters,
    merge_pieces,
    piece_buffers,
    strided_tiles,
)
from meshllm_kernels.runtime.pdl import chain_handoff
from meshllm_kernels.runtime.tensor_checks import (
    MODEL_DTYPES,
    check_shape,
    check_tensor,
    interpreting,
    next_power_of_2,
    pdl_launch,
    supports_pdl,
)


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """a * b rounded on its own: never contracted into an FMA with a following add."""
    if ASM:
        p = tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:  # the interpreter computes in numpy: no contraction
        p = a * b
    return p


@triton.jit
def _reduced(part_ptr, cols, mask, row, M, N, SPLIT_K: tl.constexpr, dtype: tl.constexpr):
    """The projection's row `row` at columns `cols`, summed over the split-K partials
    [SPLIT_K, M, N] in the reduce kernel's order and rounded to `dtype`, as fp32."""
    base = part_ptr + row.to(tl.int64) * N + cols
    if SPLIT_K == 1:  # the GEMV would store its accumulator directly
        acc = tl.load(base, mask=mask, other=0.0)
    else:
        acc = tl.zeros(cols.shape, tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(base + s * M * N, mask=mask, other=0.0)
    return acc.to(dtype).to(tl.float32)


@triton.jit
def _rotated_heads(
    part_ptr, cs_row, col0, row, M, N, offs_r, r_valid, offs_d,
    SPLIT_K: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, dtype: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Heads [R, BLOCK_D] at columns col0 + r * HEAD_DIM + d of the reduced projection,
    rotated as meshllm_kernels/attention/kv_insert.py rotates (fp32; dims past the rotary width
    pass)."""
    d = offs_d
    rot = d < 2 * ROT_HALF
    if IS_NEOX:
        first = d < ROT_HALF
        partner = tl.where(first, d + ROT_HALF, d - ROT_HALF)
        freq = tl.where(first, d, d - ROT_HALF)
    else:
        first = d % 2 == 0
        partner = tl.where(first, d + 1, d - 1)
        freq = d // 2
    partner = tl.where(rot, partner, d)
    freq = tl.where(rot, freq, 0)
    heads = col0 + offs_r[:, None] * HEAD_DIM
    mask = r_valid[:, None] & (d < HEAD_DIM)[None, :]
    x = _reduced(part_ptr, heads + d[None, :], mask, row, M, N, SPLIT_K, dtype)
    xp = _reduced(part_ptr, heads + partner[None, :], mask, row, M, N, SPLIT_K, dtype)
    cos = tl.load(cs_row + freq, mask=rot, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + ROT_HALF + freq, mask=rot, other=0.0).to(tl.float32)
    m1 = _mul_rn(x, cos[None, :], ASM)
    m2 = _mul_rn(xp, sin[None, :], ASM)
    out = tl.where(first[None, :], m1 - m2, m1 + m2)
    return tl.where(rot[None, :], out, x)


@triton.jit
def _insert_token(
    part_ptr, cs_row, cache_ptr, slot, kv_head, seq, M, N, k_scale, v_scale, offs_d,
    stride_kv, stride_block, stride_slot, stride_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLIT_K: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, FP8: tl.constexpr, dtype: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Write the row's rotated K and its V of `kv_head` at cache slot `slot`."""
    offs_r = tl.arange(0, 2)  # one row; two for a legal tile shape
    r_valid = offs_r < 1
    k = _rotated_heads(
        part_ptr, cs_row, (NUM_HEADS + kv_head) * HEAD_DIM, seq, M, N, offs_r, r_valid,
        offs_d, SPLIT_K, HEAD_DIM, ROT_HALF, IS_NEOX, dtype, ASM,
    )  # fmt: skip
    mask = r_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    v_cols = (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_r[:, None] * HEAD_DIM
    v = _reduced(part_ptr, v_cols + offs_d[None, :], mask, seq, M, N, SPLIT_K, dtype)
    dst = cache_ptr + (
        (slot // PAGE) * stride_block + (slot % PAGE) * stride_slot + kv_head * stride_head
    )
    dst = dst + offs_r[:, None] * 0 + offs_d[None, :]
    cache_dtype = cache_ptr.dtype.element_ty
    tl.store(dst, to_cache(k, k_scale, FP8, cache_dtype), mask=mask)
    tl.store(dst + stride_kv, to_cache(v, v_scale, FP8, cache_dtype), mask=mask)


@triton.jit
def _decode_from_qkv_kernel(
    part_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    slots_ptr,
    rope_rows_ptr,
    cos_sin_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    sm_scale_log2,
    max_blocks,
    M,
    N,
    stride_cs,
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
    SPLIT_K: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    FP32_DOT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Staged before the step: safe to read before the predecessor (the GEMV) is done.
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    ids = first_tile_ids(table, split, max_blocks, PAGE, BLOCK_N)
    seq_len = tl.load(seq_lens_ptr + seq)
    cs_row = cos_sin_ptr + tl.load(rope_rows_ptr + seq).to(tl.int64) * stride_cs
    k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride)
    v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride)
    chain_handoff(PDL)
    dtype = out_ptr.dtype.element_ty
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    q = _rotated_heads(
        part_ptr, cs_row, kv_head * GROUP * HEAD_DIM, seq, M, N, offs_g, g_valid, offs_d,
        SPLIT_K, HEAD_DIM, ROT_HALF, IS_NEOX, dtype, ASM,
    ).to(dtype)  # fmt: skip
    if FP32_DOT:
        q = q.to(tl.float32)
    # The new token is the sequence's last key: its tile's piece writes it, then reads it.
    if split == ((tl.maximum(seq_len, 1) - 1) // BLOCK_N) % NUM_SPLITS:
        slot = tl.load(slots_ptr + seq)
        if slot >= 0:
            _insert_token(
                part_ptr, cs_row, cache_ptr, slot, kv_head, seq, M, N, k_scale, v_scale, offs_d,
                stride_kv, stride_block, stride_slot, stride_head, NUM_HEADS, NUM_KV_HEADS,
                SPLIT_K, PAGE, HEAD_DIM, ROT_HALF, IS_NEOX, FP8, dtype, ASM,
            )  # fmt: skip
        tl.debug_barrier()
    acc, l_i, m_i = walk_piece(
        q, ids, table, max_blocks, seq_len, split, kv_head, offs_g, sm_scale_log2 * k_scale,
        cache_ptr, stride_kv, stride_block, stride_slot, stride_head,
        BLOCK_G, NUM_SPLITS, PAGE, HEAD_DIM, BLOCK_D, BLOCK_N, FP32_DOT,
    )  # fmt: skip
    finish_piece(
        acc, l_i, m_i, v_scale, seq, kv_head, split, heads, g_valid, d_valid, offs_d,
        out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, stride_ob, stride_oh,
        NUM_HEADS, NUM_KV_HEADS, NUM_SPLITS, GROUP, HEAD_DIM, FUSED_MERGE, MERGE_G, BLOCK_S,
    )  # fmt: skip


def decode_from_qkv(
    qkv_partials: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_rows: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    num_heads: int,
    num_splits: int,
    dtype: torch.dtype,
    sm_scale: float | None = None,
    is_neox: bool = True,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [B, num_heads, D] in `dtype` of B decode rows, from the qkv GEMV's
    fp32 split-K partials [split, B, (num_heads + 2 * kv_heads) * D]
    (meshllm_kernels.decode_chain.gemv `gemv_partials`; rows [q; k; v], not rotated). Each row's new
    token goes to slot_mapping[row] (< 0: not written) and is the last of its seq_lens[row] keys;
    rope_rows[row] is its row of cos_sin_cache ([rows, rotary_dim] = cos | sin).

    Same results as gemv's reduce to `dtype`, `kv_insert.insert_qkv` and
    `paged_decode.paged_decode_attention(..., num_splits, strided=True)`, in one launch,
    launched in the decode step's PDL chain where the device supports it. Its pieces are
    merged as that kernel merges them: by the last one to finish, or by the second kernel
    where the merger's registers do not allow it (`paged_decode.merge_counters`).
    """
    part = check_tensor(
        "qkv_partials", qkv_partials, dtypes=(torch.float32,), ndim=3, contiguous=True
    )
    device = part.device
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"dtype must be one of {MODEL_DTYPES}, got {dtype}")
    geo = check_kv_cache(kv_cache, device)
    split_k, num_seqs, width = part.shape
    head_dim, kv_heads = geo.head_dim, geo.num_kv_heads
    if num_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv heads ({kv_heads})")
    if width != (num_heads + 2 * kv_heads) * head_dim:
        raise ValueError(
            f"qkv_partials width {width} != (num_heads + 2 * kv_heads) * head_dim = "
            f"{(num_heads + 2 * kv_heads) * head_dim}"
        )
    if not 2 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 2..{MAX_SPLITS}, got {num_splits}")
    lens = check_seq_lens(seq_lens, num_seqs, device)
    tables = check_block_tables(block_tables, num_seqs, device)
    slots = check_tensor(
        "slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1, device=device,
        contiguous=True,
    )  # fmt: skip
    check_shape("slot_mapping", slots, (num_seqs,))
    rows = check_tensor(
        "rope_rows", rope_rows, dtypes=(torch.int32, torch.int64), ndim=1, device=device,
        contiguous=True,
    )  # fmt: skip
    check_shape("rope_rows", rows, (num_seqs,))
    table = check_tensor(
        "cos_sin_cache", cos_sin_cache, dtypes=MODEL_DTYPES, ndim=2, device=device,
        last_dim_contiguous=True,
    )  # fmt: skip
    rotary_dim = table.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos_sin_cache width {rotary_dim} must be even and in 1..{head_dim}")
    if device.type == "cpu" and num_seqs:
        capacity = tables.shape[1] * geo.block_size
        if int(lens.min()) < 1 or int(lens.max()) > capacity:
            raise ValueError(f"seq_lens must lie in 1..{capacity} (the block table's capacity)")
        if int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]:
            raise ValueError(f"rope_rows must lie in 0..{table.shape[0] - 1}")
    ks, ks_stride, vs, vs_stride = fp8_scales(geo, k_scale, v_scale, device)
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=dtype, device=device)
    if num_seqs == 0:
        return out
    tiles = (
        INTERPRETER_TILES if interpreting() else strided_tiles(head_dim, kv_cache.element_size())
    )
    group = num_heads // kv_heads
    counters = merge_counters(num_seqs, kv_heads, group, num_splits, head_dim, tiles, device)
    part_out, part_lse = piece_buffers(num_seqs, num_heads, num_splits, head_dim, device)
    use_pdl = supports_pdl(device)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    _decode_from_qkv_kernel[(num_seqs, kv_heads, num_splits)](
        part, kv_cache, tables, lens, slots, rows, table, ks, vs, out, part_out, part_lse,
        lens if counters is None else counters, scale * LOG2E, tables.shape[1],
        num_seqs, width, table.stride(0), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        tables.stride(0), ks_stride, vs_stride,
        NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads, NUM_SPLITS=num_splits, SPLIT_K=split_k,
        PAGE=geo.block_size, GROUP=group, BLOCK_G=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),
        ROT_HALF=rotary_dim // 2, IS_NEOX=bool(is_neox), BLOCK_N=tiles.block_n,
        FP8=geo.is_fp8, FP32_DOT=interpreting() or dtype == torch.float32,
        FUSED_MERGE=counters is not None, MERGE_G=max(2, next_power_of_2(group)),
        BLOCK_S=max(2, next_power_of_2(num_splits)), PDL=use_pdl, ASM=not interpreting(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(use_pdl),
    )  # fmt: skip
    if counters is None:
        merge_pieces(part_out, part_lse, out)
    return out


def decode_from_qkv_reference(
    qkv: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_rows: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    num_heads: int,
    sm_scale: float | None = None,
    is_neox: bool = True,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The same step in PyTorch from the reduced qkv [B, width] (in the model dtype): the
    insert's reference, then the decode reference; writes kv_cache in place."""
    from meshllm_kernels.attention.kv_insert import kv_insert_reference
    from meshllm_kernels.attention.paged_decode import paged_decode_reference

    kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    q_size, kv_size = num_heads * head_dim, kv_heads * head_dim
    b = qkv.shape[0]
    q = qkv[:, :q_size].reshape(b, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(b, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].reshape(b, kv_heads, head_dim)
    q_rot = kv_insert_reference(
        q, k, v, kv_cache, slot_mapping, rope_rows, cos_sin_cache, is_neox=is_neox,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    assert q_rot is not None
    return paged_decode_reference(
        q_rot, kv_cache, block_tables, seq_lens, sm_scale=sm_scale, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
