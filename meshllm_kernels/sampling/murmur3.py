"""The counter RNG of the sampler: Murmur3 x86_32 over (seed, position, token id), as tensors.

Every random number the sampler draws is a pure function of four 32-bit words — seed low,
seed high, position, token id — so a draw never depends on batch composition, row order,
device or how many draws came before (CONTRACTS.md "Gumbel-max sampling with a Murmur3
counter RNG").

The hash is exactly MurmurHash3_x86_32 of the 16-byte little-endian key
`seed_lo | seed_hi | position | token_id` with the Murmur3 seed set to a domain value: four
body rounds (c1 = 0xCC9E2D51, c2 = 0x1B873593, rotl 15 then rotl 13, h = 5h + 0xE6546B64), no
tail, `h ^= 16` (the key length in bytes, as Murmur3 mixes it in), then fmix32. So
`mmh3.hash(key, DOMAIN, signed=False)` reproduces it, and so does any Murmur3 implementation.

Arithmetic: torch 2.13 on CPU has no shifts or adds for uint32, so the hot path works on int32
tensors holding the same bit patterns: multiplies and adds wrap modulo 2^32 as uint32 ones do
(two's complement), and a logical right shift is an arithmetic one with the sign bits masked
off. The public word functions return int64 in [0, 2^32), the plain value of each word. Every
result is checked against mmh3 and a scalar implementation in the tests.
"""

from __future__ import annotations

import torch

# Domain of the primary hash: the first 32 bits of the fractional part of sqrt(2) (SHA-256's
# first IV word), an arbitrary nothing-up-my-sleeve constant that separates these draws from
# any other use of Murmur3 with seed 0.
DOMAIN = 0x6A09E667
# Domain of the second hash of the 64-bit variant (CONTRACTS.md).
DOMAIN_64 = 0x9E3779B9
KEY_BYTES = 16

C1 = 0xCC9E2D51
C2 = 0x1B873593
MASK32 = 0xFFFFFFFF

_TWO_M16 = 2.0**-16
_TWO_M32 = 2.0**-32
_TWO_M53 = 2.0**-53
# Largest float32 below 1, and largest float64 below 1: where an exact 1.0 is mapped.
ONE_BELOW_F32 = 1.0 - 2.0**-24
ONE_BELOW_F64 = 1.0 - 2.0**-53


def _signed(value: int) -> int:
    """The int32 holding the bit pattern of a 32-bit constant."""
    return value - 2**32 if value >= 2**31 else value


_C1 = _signed(C1)
_C2 = _signed(C2)
_ROUND_ADD = _signed(0xE6546B64)
_FMIX1 = _signed(0x85EBCA6B)
_FMIX2 = _signed(0xC2B2AE35)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns of integer values taken modulo 2^32 (a new tensor)."""
    return x.to(torch.int64, copy=True).bitwise_and_(MASK32).to(torch.int32)


def _shr(x: torch.Tensor, r: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (a new tensor)."""
    return torch.bitwise_right_shift(x, r).bitwise_and_((1 << (32 - r)) - 1)


def _rotl_(x: torch.Tensor, r: int) -> torch.Tensor:
    """Rotate int32 bit patterns left by r, in place."""
    high = _shr(x, 32 - r)
    return x.bitwise_left_shift_(r).bitwise_or_(high)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """Murmur3's final avalanche on int32 bit patterns, in place."""
    h.bitwise_xor_(_shr(h, 16)).mul_(_FMIX1)
    h.bitwise_xor_(_shr(h, 13)).mul_(_FMIX2)
    return h.bitwise_xor_(_shr(h, 16))


def split_seed(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) 32-bit words of 64-bit seeds held as int64 (the bit pattern of a uint64)."""
    seed = seed.to(torch.int64)
    return seed & MASK32, (seed >> 32) & MASK32


def _mix_word(word: torch.Tensor) -> torch.Tensor:
    k = _bits(word).mul_(_C1)
    return _rotl_(k, 15).mul_(_C2)


def _round(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """One Murmur3 body round on int32 bit patterns; a new tensor (h broadcast against word)."""
    h = torch.bitwise_xor(h, _mix_word(word))
    return _rotl_(h, 13).mul_(5).add_(_ROUND_ADD)


def _word_values(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64).bitwise_and_(MASK32)


def murmur3_prefix(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor, domain: int = DOMAIN
) -> torch.Tensor:
    """The hash state after the three words a sampled row shares (seed low, high, position);
    int64 in [0, 2^32). Split out so a [B, V] draw hashes these once per row, not per token.
    """
    h = torch.full((), _signed(domain), dtype=torch.int32, device=seed_lo.device)
    for word in (seed_lo, seed_hi, position):
        h = _round(h, word)
    return _word_values(h)


def murmur3_finish_bits(prefix: torch.Tensor, token_id: torch.Tensor) -> torch.Tensor:
    """Mix in the token id, the key length and the final avalanche; int32 bit patterns.

    The sampler's hot path: uniform_from_bits takes these directly.
    """
    return _fmix32_(_round(_bits(prefix), token_id).bitwise_xor_(KEY_BYTES))


def murmur3_finish(prefix: torch.Tensor, token_id: torch.Tensor) -> torch.Tensor:
    """murmur3_finish_bits as int64 word values in [0, 2^32)."""
    return _word_values(murmur3_finish_bits(prefix, token_id))


def murmur3_words(
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    position: torch.Tensor,
    token_id: torch.Tensor,
    domain: int = DOMAIN,
) -> torch.Tensor:
    """Murmur3 x86_32 of the four words (broadcast together); int64 result in [0, 2^32).

    Inputs may be any integer tensors; each word is taken modulo 2^32 (a position past 2^32
    wraps, which only matters for positions no model reaches).
    """
    return murmur3_finish(murmur3_prefix(seed_lo, seed_hi, position, domain), token_id)


def uniform_from_bits(r: torch.Tensor) -> torch.Tensor:
    """float32 uniform in (0, 1) from 32 random bits, losing none of them ("split-16").

    r: int32 bit patterns or int64 values in [0, 2^32).

    u = (r >> 16)·2^-16 + ((r & 0xFFFF) + 0.5)·2^-32: both terms are exact in float32 (16 and
    17 significant bits) and their float32 sum is one correctly rounded addition, so u is the
    correctly rounded (r + 0.5)/2^32. The smallest value is 2^-33, never 0. The top 128 words
    (r >= 2^32 - 128) round to exactly 1.0; those are mapped down to 1 - 2^-24, the largest
    float32 below 1, so u is never 1 either (the same open right end as the 64-bit variant).
    The result is bit-identical on every IEEE device, which is what lets the Triton kernel and
    this reference agree bit for bit.
    """
    hi = _shr(r, 16).to(torch.float32).mul_(_TWO_M16)
    lo = (r & 0xFFFF).to(torch.float32).add_(0.5).mul_(_TWO_M32)
    return hi.add_(lo).clamp_max_(ONE_BELOW_F32)


def uniform64_from_bits(r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """float64 uniform in (0, 1) from two 32-bit hashes: r53 = r1·2^21 + (r2 >> 11).

    u = (r53 + 0.5)·2^-53 rounded once to float64 (the product by a power of two is exact), so
    u is the correctly rounded (r53 + 0.5)/2^53. Only r53 = 2^53 - 1 rounds to exactly 1.0; it
    is mapped down by 2^-53 to 1 - 2^-53.
    """
    r53 = (r1.to(torch.int64) << 21) | (r2.to(torch.int64) >> 11)
    u = (r53.to(torch.float64) + 0.5) * _TWO_M53
    return u.clamp_max_(ONE_BELOW_F64)


def uniform32(seed: torch.Tensor, position: torch.Tensor, token_id: torch.Tensor) -> torch.Tensor:
    """The sampler's float32 uniform for (seed, position, token id), broadcast together."""
    seed_lo, seed_hi = split_seed(seed)
    return uniform_from_bits(murmur3_words(seed_lo, seed_hi, position, token_id))


def uniform64(seed: torch.Tensor, position: torch.Tensor, token_id: torch.Tensor) -> torch.Tensor:
    """The float64 variant: the primary hash and a second one in domain 0x9E3779B9."""
    seed_lo, seed_hi = split_seed(seed)
    r1 = murmur3_words(seed_lo, seed_hi, position, token_id, DOMAIN)
    r2 = murmur3_words(seed_lo, seed_hi, position, token_id, DOMAIN_64)
    return uniform64_from_bits(r1, r2)
