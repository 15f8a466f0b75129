"""Gumbel noise from the counter RNG, and Gumbel-max sampling in PyTorch.

Sampling is argmax over tokens of `logits · (1/T) + g`, g = -log(-log(1 - u)) with u from
murmur3.uniform32(seed, position, token id) — exactly a draw from softmax(logits / T) and a
pure function of (seed, position, logits), whatever else is in the batch.

Bit-exactness across devices. The Triton kernel (meshllm_kernels/sampling/gumbel_kernel.py) must
produce the same noise bits and the same tokens as this code, on CPU and on CUDA. Device math
libraries disagree in the last ulp of `log`, and compilers may fuse a*b + c into one FMA, so this
module uses only IEEE-exact basic operations (+, -, *, comparisons, bit casts), each rounded on its
own: `log_f32` is a Cephes-style logf built from them, the temperature is applied as a
multiplication by a precomputed reciprocal (Triton's fp32 division is approximate), and the kernel
is compiled with fp fusion off. Constants are float32 values written exactly.

Noise (CONTRACTS.md). With v = u: E = -log(1 - v) is an Exp(1) variate and g = -log(E). For
v < 0.25, log(1 - v) is the degree-8 Taylor series -(v + v²/2 + … + v⁸/8) in Horner form, so
the u → 0 tail (where 1 - v would round to 1 and g would be +inf) keeps full resolution:
u = 2^-33 gives g ≈ 22.9. Otherwise log(max(1 - v, 2^-24)): the RNG's largest u is 1 - 2^-24,
so the guard never binds on its output, but keeps any u <= 1 finite. The truncated series is
off by at most ~2.3e-6 relative at v = 0.25, far below any effect on sampling frequencies.
"""

from __future__ import annotations

import torch

from meshllm_kernels.sampling.bitmask import allowed_mask
from meshllm_kernels.sampling.murmur3 import (
    murmur3_finish_bits,
    murmur3_prefix,
    split_seed,
    uniform32,
    uniform_from_bits,
)

TWO_M24 = 2.0**-24
# Range reduction of logf without a comparison (musl's trick): adding this to the bits of a
# positive float carries into the exponent exactly when the mantissa is >= that of sqrt(.5).
SQRT_HALF_BITS = 0x3F3504F3  # float32(sqrt(.5))
REDUCE_OFFSET = 0x3F800000 - SQRT_HALF_BITS
LN2_HI = 0.693359375  # ln 2 split in two: the high part has few bits, so k·LN2_HI is exact
LN2_LO = -2.12194440e-4
# Cephes logf minimax polynomial for (log(1 + f) - f + f²/2) / f³ over [sqrt(.5)-1, sqrt(2)-1].
LOG_POLY = (
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
)
# 1/8, 1/7, ..., 1/2, 1: Horner coefficients of -log(1 - v)/v truncated after v⁷/8.
LOG1M_SERIES = tuple(1.0 / k for k in range(8, 0, -1))
SERIES_LIMIT_BITS = 0x3E800000  # 0.25: v < 0.25 iff its bits are below these (v > 0)
# Bound on |g| over every u the RNG can produce: g_max = -log(2^-33 (1 + tiny)) < 22.9 and
# g_min = -log(log(2^24)) > -2.82. A token whose scaled logit trails the row maximum by more
# than their sum (25.7) can never win the argmax; 32 leaves room.
GUMBEL_SPAN = 32.0

# Rows per chunk so that the int64 hash temporaries stay near 2^21 elements each.
_CHUNK_ELEMENTS = 1 << 21
# Below one candidate in this many tokens, hash only the candidates (gather/scatter pays off).
_SPARSE_FRACTION = 4


def _f32(x: float) -> float:
    """x rounded to float32, so every device and framework sees the same constant."""
    return float(torch.tensor(x, dtype=torch.float32))


LOG_POLY_F32 = tuple(_f32(c) for c in LOG_POLY)
LOG1M_SERIES_F32 = tuple(_f32(c) for c in LOG1M_SERIES)
LN2_LO_F32 = _f32(LN2_LO)

# The functions below work in place on fresh buffers: on CPU an allocating op costs several
# times the arithmetic (page faults on large temporaries). Each in-place op is still one IEEE
# operation, in the order the Triton kernel performs them.


def _log_f32_(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values, in place (Cephes logf, <= 1 ulp).

    x = m·2^k with m in [sqrt(.5), sqrt(2)); log x = k·ln2 + log(1 + f), f = m - 1, and
    log(1 + f) = f - f²/2 + f³·P(f). The split is read from the bits, every step is a single
    IEEE rounding, so the result is the same bits on every device (module docstring).
    """
    bits = x.view(torch.int32).add_(REDUCE_OFFSET)
    k = (bits >> 23).sub_(0x7F).to(torch.float32)
    bits.bitwise_and_(0x007FFFFF).add_(SQRT_HALF_BITS)
    f = x.sub_(1.0)
    z = f * f
    y = torch.full_like(f, LOG_POLY_F32[0])
    for c in LOG_POLY_F32[1:]:
        y.mul_(f).add_(c)
    y.mul_(f).mul_(z)
    y.add_(k * LN2_LO_F32)
    y.sub_(z.mul_(0.5))
    return f.add_(y).add_(k.mul_(LN2_HI))


def _gumbel_from_uniform_(u: torch.Tensor) -> torch.Tensor:
    """g = -log(-log(1 - u)), in place on u."""
    series = torch.full_like(u, LOG1M_SERIES_F32[0])
    for c in LOG1M_SERIES_F32[1:]:
        series.mul_(u).add_(c)
    series.mul_(u)  # -log(1 - u) for u < 0.25
    # -u + 1 is the same IEEE operation as 1 - u.
    direct = _log_f32_(u.neg().add_(1.0).clamp_min_(TWO_M24)).neg_()
    # E = series where u < 0.25 else direct, selected bitwise (torch.where on a bool mask is
    # slow on CPU): `below` is all ones where u's bits are below those of 0.25.
    below = (u.view(torch.int32) - SERIES_LIMIT_BITS).bitwise_right_shift_(31)
    diff = series.view(torch.int32).bitwise_xor_(direct.view(torch.int32)).bitwise_and_(below)
    exp_var = direct.view(torch.int32).bitwise_xor_(diff).view(torch.float32)
    return _log_f32_(exp_var).neg_()


def log_f32(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values, bit-identical on every device."""
    return _log_f32_(x.to(torch.float32, copy=True))


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise g = -log(-log(1 - u)) in float32, u in (0, 1)."""
    return _gumbel_from_uniform_(u.to(torch.float32, copy=True))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 noise: row i is keyed by (seeds[i], positions[i]), column j by token j."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    u = uniform32(seeds.reshape(-1, 1), positions.reshape(-1, 1), token_ids)
    return gumbel_from_uniform(u)


def gumbel_argmax(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    bitmask_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: argmax(logits · inv_T + g) over allowed tokens; int64 [B].

    `inv_temperature[i] == 0` marks a greedy row (T == 0): plain argmax of its logits, no
    noise. `bitmask` is packed int32 [G, W] (see bitmask.py); row i uses bitmask row
    `bitmask_index[i]`, or none when that is -1 (default: row i when G == B). Ties, including
    a row whose every token is -inf, go to the smallest token id, as torch.argmax does.

    This is the PyTorch reference of meshllm_kernels/sampling/gumbel_kernel.py and the CPU sampler.
    Rows are done in chunks to bound memory. Tokens whose scaled logit trails the row maximum by
    more than GUMBEL_SPAN cannot win; when they are most of the chunk (low temperature, peaked
    logits) noise is computed for the candidates only, which changes no result.
    """
    logits = logits.float()
    if bitmask is not None:
        if bitmask_index is None:
            bitmask_index = torch.arange(logits.shape[0], device=logits.device)
        logits = logits.masked_fill(
            ~allowed_mask(bitmask, bitmask_index, logits.shape[1]), float("-inf")
        )
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        sl = slice(start, min(rows, start + step))
        out[sl] = _gumbel_argmax_rows(logits[sl], inv_temperature[sl], seeds[sl], positions[sl])
    return out


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """argmax along dim 1 with torch.argmax's answers (the first maximum; a NaN counts as the
    maximum; an all -inf row gives 0), through `max(dim=1)`, which is the faster of the two
    on CPU at vocabulary widths."""
    return scores.max(dim=1).indices


def _gumbel_argmax_rows(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    out = row_argmax(logits)
    rand = (inv_temperature != 0).nonzero().squeeze(1)
    if rand.numel() == 0:
        return out
    scaled = logits[rand] * inv_temperature[rand].unsqueeze(1)
    seed_lo, seed_hi = split_seed(seeds[rand])
    prefix = murmur3_prefix(seed_lo, seed_hi, positions[rand])
    row_max = scaled.amax(dim=1, keepdim=True)
    # A token can win only if its scaled logit is within GUMBEL_SPAN of the row maximum; the
    # relative term covers float rounding of the sums at huge magnitudes. An infinite maximum
    # is its own threshold; `> -inf` leaves an all -inf row candidate-free (its answer, token 0,
    # is the argmax of -inf scores anyway).
    reach = GUMBEL_SPAN + row_max.abs() * 2.0**-16
    threshold = torch.where(row_max.isinf(), row_max, row_max - reach)
    candidate = (scaled >= threshold) & (scaled > float("-inf"))
    num_candidates = int(candidate.sum())
    if num_candidates * _SPARSE_FRACTION >= candidate.numel():
        token_ids = torch.arange(logits.shape[1], dtype=torch.int64, device=logits.device)
        u = uniform_from_bits(murmur3_finish_bits(prefix.unsqueeze(1), token_ids))
        score = scaled + gumbel_from_uniform(u)
    else:
        score = torch.full_like(scaled, float("-inf"))
        row_idx, tok_idx = candidate.nonzero(as_tuple=True)
        u = uniform_from_bits(murmur3_finish_bits(prefix[row_idx], tok_idx))
        score[row_idx, tok_idx] = scaled[row_idx, tok_idx] + gumbel_from_uniform(u)
    out[rand] = row_argmax(score)
    return out
