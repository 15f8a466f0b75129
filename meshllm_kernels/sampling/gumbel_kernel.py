"""Fused Gumbel-max sampling: Murmur3 hash -> uniform -> Gumbel -> logits/T + g -> argmax.

One Triton program scores one chunk of one row's vocabulary: it hashes (seed, position, token
id) for each token, turns the hash into Gumbel noise, applies the grammar bitmask, and keeps a
running per-lane maximum, then stores its chunk's best (score, token id). The last program of a
row to finish (an acq_rel count in meshllm_kernels/runtime/completion_counters.py) picks the row's
best chunk and writes the token, so one sampling step is one launch: with `rows` the kernel also
reads the temperature and seed from per-request state tables and can store the token into a feed
table. Where no counters can be had (first use inside a CUDA graph capture) the launcher picks the
best chunk in torch instead, with the same result. The logits are read once and no [B, V] noise
tensor ever exists.

Reference: `gumbel_argmax_reference` (meshllm_kernels/sampling/gumbel.py, built on
sampling/murmur3.py) is the same computation in PyTorch, and the CPU sampler. The kernel repeats
its operations one for one — integer hash in uint32 (wrapping multiplies, logical shifts), the
split-16 uniform, a logf made of single IEEE operations, temperature as a multiplication by
1/T — and is compiled with fp fusion off (no a*b+c contracted to FMA), so uniforms and noise
are equal bit for bit and so are the tokens, ties included (smallest token id wins, as
torch.argmax). NaN logits are outside the contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.runtime import completion_counters
from meshllm_kernels.runtime.specialization import jit_options
from meshllm_kernels.runtime.tensor_checks import (
    INDEX_DTYPES,
    MODEL_DTYPES,
    check_shape,
    check_tensor,
    interpreting,
    next_power_of_2,
    pdl_launch,
    supports_pdl,
)
from meshllm_kernels.sampling.gumbel import (
    LN2_HI,
    LN2_LO_F32,
    LOG1M_SERIES_F32,
    LOG_POLY_F32,
    REDUCE_OFFSET,
    SERIES_LIMIT_BITS,
    SQRT_HALF_BITS,
    TWO_M24,
)
from meshllm_kernels.sampling.gumbel import gumbel_argmax as gumbel_argmax_reference
from meshllm_kernels.sampling.gumbel import gumbel_noise as gumbel_noise_reference
from meshllm_kernels.sampling.murmur3 import C1, C2, DOMAIN, KEY_BYTES, ONE_BELOW_F32

__all__ = ["gumbel_argmax_reference", "gumbel_argmax_triton", "gumbel_noise_reference"]

BLOCK = 1024
# Enough programs to fill a large GPU even at batch 1 (an H200 has 132 SMs).
TARGET_PROGRAMS = 1024
COUNTERS = "sampler"  # completion_counters family of the fused reduction over chunks

_C1: tl.constexpr = tl.constexpr(C1)
_C2: tl.constexpr = tl.constexpr(C2)
_DOMAIN: tl.constexpr = tl.constexpr(DOMAIN)
_KEY_BYTES: tl.constexpr = tl.constexpr(KEY_BYTES)
_ONE_BELOW: tl.constexpr = tl.constexpr(ONE_BELOW_F32)
_TWO_M24: tl.constexpr = tl.constexpr(TWO_M24)
_REDUCE_OFFSET: tl.constexpr = tl.constexpr(REDUCE_OFFSET)
_SQRT_HALF_BITS: tl.constexpr = tl.constexpr(SQRT_HALF_BITS)
_SERIES_LIMIT: tl.constexpr = tl.constexpr(SERIES_LIMIT_BITS)
_LN2_HI: tl.constexpr = tl.constexpr(LN2_HI)
_LN2_LO: tl.constexpr = tl.constexpr(LN2_LO_F32)
_P0: tl.constexpr = tl.constexpr(LOG_POLY_F32[0])
_P1: tl.constexpr = tl.constexpr(LOG_POLY_F32[1])
_P2: tl.constexpr = tl.constexpr(LOG_POLY_F32[2])
_P3: tl.constexpr = tl.constexpr(LOG_POLY_F32[3])
_P4: tl.constexpr = tl.constexpr(LOG_POLY_F32[4])
_P5: tl.constexpr = tl.constexpr(LOG_POLY_F32[5])
_P6: tl.constexpr = tl.constexpr(LOG_POLY_F32[6])
_P7: tl.constexpr = tl.constexpr(LOG_POLY_F32[7])
_P8: tl.constexpr = tl.constexpr(LOG_POLY_F32[8])
_S0: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[0])
_S1: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[1])
_S2: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[2])
_S3: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[3])
_S4: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[4])
_S5: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[5])
_S6: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[6])
_S7: tl.constexpr = tl.constexpr(LOG1M_SERIES_F32[7])


@triton.jit
def _rotl(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _murmur_round(h, word):
    k = word * _C1
    k = _rotl(k, 15)
    k = k * _C2
    h = _rotl(h ^ k, 13)
    return h * 5 + 0xE6546B64


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _log_f32(x):
    """Cephes logf from single IEEE operations: the same bits as gumbel._log_f32_."""
    bits = x.to(tl.int32, bitcast=True) + _REDUCE_OFFSET
    k = ((bits >> 23) - 0x7F).to(tl.float32)
    m = ((bits & 0x007FFFFF) + _SQRT_HALF_BITS).to(tl.float32, bitcast=True)
    f = m - 1.0
    z = f * f
    y = _P0 * f + _P1
    y = y * f + _P2
    y = y * f + _P3
    y = y * f + _P4
    y = y * f + _P5
    y = y * f + _P6
    y = y * f + _P7
    y = y * f + _P8
    y = (y * f) * z
    y = y + k * _LN2_LO
    y = y - z * 0.5
    return (f + y) + k * _LN2_HI


@triton.jit
def _uniform_and_gumbel(prefix, tokens):
    """(u, g) for one block of token ids, given the row's hash state after three words."""
    r = _fmix32(_murmur_round(prefix, tokens) ^ _KEY_BYTES)
    hi = (r >> 16).to(tl.float32) * (1.0 / 65536.0)
    lo = ((r & 0xFFFF).to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
    u = tl.minimum(hi + lo, _ONE_BELOW)
    s = _S0 * u + _S1
    s = s * u + _S2
    s = s * u + _S3
    s = s * u + _S4
    s = s * u + _S5
    s = s * u + _S6
    s = s * u + _S7
    series = s * u
    direct = -_log_f32(tl.maximum(1.0 - u, _TWO_M24))
    exp_var = tl.where(u.to(tl.int32, bitcast=True) < _SERIES_LIMIT, series, direct)
    return u, -_log_f32(exp_var)


# num_chunks depends on the batch size: not specialized on (whether it is 1 or a multiple of
# 16), and BLOCK_CHUNKS fixed per vocabulary, so that a batch of a size not met before launches
# the compiled kernel instead of compiling another (a serving step held ~0.5 s on the H200).
# Nor is the alignment of the per-row arrays: the worker passes rows and positions as the two
# rows of one upload, so the positions start 16-byte aligned at even batch sizes only.
@triton.jit(
    **jit_options(
        values=["num_chunks"],
        alignments=["state_row_ptr", "position_ptr", "bitmask_index_ptr"],
    )
)
def _gumbel_argmax_kernel(
    logits_ptr,
    logits_row_stride,
    inv_temp_ptr,
    inv_temp_stride,
    seed_ptr,
    seed_stride,
    state_row_ptr,
    position_ptr,
    bitmask_ptr,
    bitmask_index_ptr,
    bitmask_words,
    part_val_ptr,
    part_idx_ptr,
    counter_ptr,
    out_ptr,
    feed_ptr,
    u_ptr,
    g_ptr,
    vocab_size,
    chunk,
    num_chunks,
    HAS_ROWS: tl.constexpr,
    FEED: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    HAS_BITMASK: tl.constexpr,
    WRITE_NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # launched while the LM head drains: nothing is read before it has finished
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    part = tl.program_id(1)
    row64 = row.to(tl.int64)
    state = row64
    if HAS_ROWS:
        state = tl.load(state_row_ptr + row).to(tl.int64)
    inv_t = tl.load(inv_temp_ptr + state * inv_temp_stride)
    seed = tl.load(seed_ptr + state * seed_stride).to(tl.int64)
    position = tl.load(position_ptr + row).to(tl.int64)
    # The three words a row shares: hashed once per program.
    h = tl.full((), _DOMAIN, tl.uint32)
    h = _murmur_round(h, seed.to(tl.uint32))
    h = _murmur_round(h, (seed >> 32).to(tl.uint32))
    prefix = _murmur_round(h, position.to(tl.uint32))
    mask_row = tl.full((), -1, tl.int32)
    if HAS_BITMASK:
        mask_row = tl.load(bitmask_index_ptr + row).to(tl.int32)

    start = part * chunk
    end = tl.minimum(start + chunk, vocab_size)
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = start + lanes
    for block_start in range(start, end, BLOCK):
        offs = block_start + lanes
        in_vocab = offs < end
        x = tl.load(
            logits_ptr + row64 * logits_row_stride + offs, mask=in_vocab, other=float("-inf")
        ).to(tl.float32)
        # Two ifs: the first is resolved at compile time, the second per row.
        if HAS_BITMASK:  # noqa: SIM102
            if mask_row >= 0:
                word_idx = offs // 32
                word = tl.load(
                    bitmask_ptr + mask_row.to(tl.int64) * bitmask_words + word_idx,
                    mask=in_vocab & (word_idx < bitmask_words),
                    other=0,
                )
                allowed = ((word >> (offs % 32)) & 1) != 0
                x = tl.where(allowed, x, float("-inf"))
        if inv_t == 0.0:
            score = x
        else:
            u, g = _uniform_and_gumbel(prefix, offs.to(tl.uint32))
            if WRITE_NOISE:
                noise_offs = row64 * vocab_size + offs
                tl.store(u_ptr + noise_offs, u, mask=in_vocab)
                tl.store(g_ptr + noise_offs, g, mask=in_vocab)
            score = x * inv_t + g
        better = score > best_val
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, axis=0)
    top_idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(part_val_ptr + row64 * num_chunks + part, top)
    tl.store(part_idx_ptr + row64 * num_chunks + part, top_idx)
    if FUSED_REDUCE:
        # Every thread's partial stores come before the release of the count; the last
        # program of the row reads the partials from L2 (".cg": other SMs wrote them).
        tl.debug_barrier()
        counter = counter_ptr + row
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == num_chunks - 1:
            offs_c = tl.arange(0, BLOCK_CHUNKS)
            valid = offs_c < num_chunks
            vals = tl.load(
                part_val_ptr + row64 * num_chunks + offs_c,
                mask=valid,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            idxs = tl.load(
                part_idx_ptr + row64 * num_chunks + offs_c,
                mask=valid,
                other=0,
                cache_modifier=".cg",
            )
            # The first chunk holding the maximum, as torch.argmax picks it (chunk 0 when
            # every score is -inf).
            best = tl.max(vals, axis=0)
            first = tl.min(tl.where(valid & (vals == best), offs_c, BLOCK_CHUNKS), axis=0)
            token = tl.sum(tl.where(offs_c == first, idxs, 0), axis=0).to(tl.int64)
            tl.store(out_ptr + row, token)
            if FEED:
                tl.store(feed_ptr + state, token)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (CUDA graph replays)


def _check_inputs(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    bitmask: torch.Tensor | None,
    bitmask_index: torch.Tensor | None,
    rows: torch.Tensor | None,
    feed: torch.Tensor | None,
) -> None:
    logits = check_tensor("logits", logits, dtypes=MODEL_DTYPES, ndim=2, last_dim_contiguous=True)
    device = logits.device
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"logits are on {device}: the Triton sampler runs on CUDA tensors (or on CPU tensors "
            "under TRITON_INTERPRET=1); use gumbel_argmax_reference on CPU"
        )
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary dimension")
    if vocab >= 2**31:
        raise ValueError(f"vocabulary of {vocab} tokens does not fit int32 token ids")
    _check_state(inv_temperature, seeds, rows, feed, batch, device)
    check_tensor(
        "positions", positions, dtypes=INDEX_DTYPES, ndim=1, device=device, contiguous=True
    )
    check_shape("positions", positions, (batch,))
    if bitmask is None:
        if bitmask_index is not None:
            raise ValueError("bitmask_index given without a bitmask")
        return
    check_tensor("bitmask", bitmask, dtypes=(torch.int32,), ndim=2, device=device, contiguous=True)
    if bitmask.shape[1] == 0:
        raise ValueError("bitmask has no words per row")
    if bitmask_index is None:
        if bitmask.shape[0] != batch:
            raise ValueError(
                f"bitmask has {bitmask.shape[0]} rows for {batch} logits rows; pass "
                "bitmask_index to map batch rows to bitmask rows"
            )
        return
    check_tensor(
        "bitmask_index", bitmask_index, dtypes=INDEX_DTYPES, ndim=1, device=device, contiguous=True
    )
    check_shape("bitmask_index", bitmask_index, (batch,))


def _check_state(
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    rows: torch.Tensor | None,
    feed: torch.Tensor | None,
    batch: int,
    device: torch.device,
) -> None:
    """inv_temperature and seeds: [B] each, or with `rows` [B] state tables [R] (and feed [R]);
    either may be strided (a column of the sampler's parameter table)."""
    check_tensor("inv_temperature", inv_temperature, dtypes=(torch.float32,), ndim=1, device=device)
    check_tensor("seeds", seeds, dtypes=(torch.int64,), ndim=1, device=device)
    if rows is None:
        if feed is not None:
            raise ValueError(
                "feed given without rows (the token of batch row b goes to feed[rows[b]])"
            )
        check_shape("inv_temperature", inv_temperature, (batch,))
        check_shape("seeds", seeds, (batch,))
        return
    check_tensor("rows", rows, dtypes=INDEX_DTYPES, ndim=1, device=device, contiguous=True)
    check_shape("rows", rows, (batch,))
    table = inv_temperature.shape[0]
    if table == 0:
        raise ValueError("inv_temperature is an empty state table, indexed by rows")
    check_shape("seeds", seeds, (table,))
    if feed is not None:
        check_tensor("feed", feed, dtypes=(torch.int64,), ndim=1, device=device, contiguous=True)
        check_shape("feed", feed, (table,))


def gumbel_argmax_triton(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    bitmask_index: torch.Tensor | None = None,
    *,
    noise_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: torch.Tensor | None = None,
    feed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sampled token ids, int64 [B]; the same contract as gumbel_argmax_reference.

    logits [B, V] fp32/fp16/bf16 (last dim contiguous); inv_temperature [B] fp32, 0 = greedy;
    seeds [B] int64 (uint64 bit patterns); positions [B] int32/int64 (already salted);
    bitmask int32 [G, W] with bitmask_index [B] (-1 = unconstrained; values must lie in
    [-1, G): they are not checked, to keep the launch free of host syncs), or G == B without
    an index. `noise_out` = (u, g), float32 [B, V] each, receives the uniforms and Gumbel noise
    of every non-greedy row (for tests and tools; it costs a full write of both).

    `rows` int32/int64 [B] maps batch rows to request state rows: inv_temperature and seeds are
    then state tables [R] (R >= 1), read at rows[b] by the kernel (values must lie in [0, R):
    not checked, as bitmask_index). `feed` int64 [R], only with rows, also receives the token
    of batch row b at feed[rows[b]] (rows repeated with a feed: one of their tokens is kept).
    Positions, bitmask_index and the result stay per batch row.
    """
    _check_inputs(logits, inv_temperature, seeds, positions, bitmask, bitmask_index, rows, feed)
    batch, vocab = logits.shape
    device = logits.device
    write_noise = noise_out is not None
    if noise_out is not None:
        for name, t in zip(("noise_out[0]", "noise_out[1]"), noise_out, strict=True):
            check_tensor(name, t, dtypes=(torch.float32,), ndim=2, device=device, contiguous=True)
            check_shape(name, t, (batch, vocab))
        u_out, g_out = noise_out
    else:
        u_out = g_out = torch.empty(1, dtype=torch.float32, device=device)
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    has_bitmask = bitmask is not None
    if bitmask is None:
        bitmask = torch.empty(1, 1, dtype=torch.int32, device=device)  # never read
    if has_bitmask and bitmask_index is None:
        bitmask_index = torch.arange(batch, dtype=torch.int32, device=device)
    if bitmask_index is None:
        bitmask_index = torch.empty(1, dtype=torch.int32, device=device)
    chunks_wanted = max(1, -(-TARGET_PROGRAMS // batch))
    chunk = max(BLOCK, -(-vocab // chunks_wanted))
    chunk = -(-chunk // BLOCK) * BLOCK
    num_chunks = -(-vocab // chunk)
    part_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=device)
    part_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
    out = torch.empty(batch, dtype=torch.int64, device=device)
    counters = completion_counters.counters(COUNTERS, device, batch)
    # Programmatic dependent launch after the LM head GEMV (which lets its dependents start).
    use_pdl = supports_pdl(device)
    _gumbel_argmax_kernel[(batch, num_chunks)](
        logits,
        logits.stride(0),
        inv_temperature,
        inv_temperature.stride(0),
        seeds,
        seeds.stride(0),
        positions if rows is None else rows,
        positions,
        bitmask,
        bitmask_index,
        bitmask.shape[1],
        part_val,
        part_idx,
        part_idx if counters is None else counters,
        out,
        out if feed is None else feed,
        u_out,
        g_out,
        vocab,
        chunk,
        num_chunks,
        HAS_ROWS=rows is not None,
        FEED=feed is not None,
        FUSED_REDUCE=counters is not None,
        HAS_BITMASK=has_bitmask,
        WRITE_NOISE=write_noise,
        BLOCK=BLOCK,
        # the most chunks any batch takes (batch 1: chunks of BLOCK), whatever this batch's
        BLOCK_CHUNKS=max(2, next_power_of_2(-(-vocab // BLOCK))),
        PDL=use_pdl,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_launch(use_pdl),
    )
    if counters is None:
        # torch.argmax returns the first maximum: the lowest chunk, so the lowest token id.
        best = part_val.argmax(dim=1, keepdim=True)
        out = part_idx.gather(1, best).squeeze(1).to(torch.int64)
        if feed is not None:
            feed[rows] = out
    return out
