"""The sampler's hash is Murmur3 x86_32: checked against an independent scalar implementation
(validated on SMHasher's verification value and published vectors) and against mmh3."""

from __future__ import annotations

import struct

import mmh3
import pytest
import torch

from meshllm_kernels.sampling.murmur3 import (
    DOMAIN,
    DOMAIN_64,
    murmur3_finish,
    murmur3_finish_bits,
    murmur3_prefix,
    murmur3_words,
    split_seed,
    uniform_from_bits,
)

M32 = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32


def _scramble(k: int) -> int:
    k = (k * 0xCC9E2D51) & M32
    return (_rotl(k, 15) * 0x1B873593) & M32


def murmur3_32(key: bytes, seed: int) -> int:
    """MurmurHash3_x86_32 from the reference C code, on plain Python ints (any key length)."""
    h = seed & M32
    nblocks = len(key) // 4
    for i in range(nblocks):
        h ^= _scramble(int.from_bytes(key[4 * i : 4 * i + 4], "little"))
        h = (_rotl(h, 13) * 5 + 0xE6546B64) & M32
    tail = key[4 * nblocks :]
    if tail:
        h ^= _scramble(int.from_bytes(tail, "little"))
    h ^= len(key)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def test_scalar_reference_passes_smhasher_verification() -> None:
    # SMHasher's VerificationTest: hash keys 0..i-1 with seed 256-i, then hash the hashes.
    key = bytes(range(256))
    hashes = b"".join(murmur3_32(key[:i], 256 - i).to_bytes(4, "little") for i in range(256))
    assert murmur3_32(hashes, 0) == 0xB0F57EE3


@pytest.mark.parametrize(
    ("key", "seed", "expected"),
    [
        (b"", 0, 0),
        (b"", 1, 0x514E28B7),
        (b"", 0xFFFFFFFF, 0x81F16F39),
        (b"\0\0\0\0", 0, 0x2362F9DE),
        (b"aaaa", 0x9747B28C, 0x5A97808A),
        (b"Hello, world!", 0x9747B28C, 0x24884CBA),
        (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
    ],
)
def test_scalar_reference_known_vectors(key: bytes, seed: int, expected: int) -> None:
    assert murmur3_32(key, seed) == expected


def _key(words: list[int]) -> bytes:
    return struct.pack("<4I", *words)


@pytest.mark.parametrize("domain", [DOMAIN, DOMAIN_64, 0])
def test_vectorized_hash_equals_scalar_and_mmh3(domain: int) -> None:
    gen = torch.Generator().manual_seed(domain & 0xFFFF)
    words = torch.randint(0, 2**32, (4, 2000), generator=gen, dtype=torch.int64)
    edges = torch.tensor([[0, M32, 1, 2**31], [0, M32, 2**31, 1], [0, M32, 0, 5], [0, M32, 7, 0]])
    words = torch.cat([words, edges], dim=1)
    got = murmur3_words(*words, domain=domain).tolist()
    for i, h in enumerate(got):
        key = _key(words[:, i].tolist())
        assert h == murmur3_32(key, domain) == mmh3.hash(key, domain, signed=False)


def test_words_are_taken_modulo_2_32_and_seed_splits_little_endian() -> None:
    seed = torch.tensor([0x0123456789ABCDEF, -1, 2**63 - 1, -(2**63)], dtype=torch.int64)
    lo, hi = split_seed(seed)
    assert lo.tolist() == [0x89ABCDEF, M32, M32, 0]
    assert hi.tolist() == [0x01234567, M32, 0x7FFFFFFF, 0x80000000]
    pos = torch.tensor([5, 5 + 2**32, 5, 5])
    tok = torch.tensor([9, 9, 9 - 2**32, 9])
    h = murmur3_words(lo, hi, pos, tok)
    expected = [murmur3_32(_key([int(lo[i]), int(hi[i]), 5, 9]), DOMAIN) for i in range(4)]
    assert h.tolist() == expected


def test_prefix_then_finish_equals_full_hash_with_broadcast() -> None:
    seeds = torch.tensor([3, 2**40 + 17])
    lo, hi = split_seed(seeds)
    pos = torch.tensor([11, 2**30 + 4])
    tokens = torch.arange(50)
    prefix = murmur3_prefix(lo, hi, pos)
    grid = murmur3_finish(prefix.unsqueeze(1), tokens)
    full = murmur3_words(lo.unsqueeze(1), hi.unsqueeze(1), pos.unsqueeze(1), tokens)
    assert torch.equal(grid, full)
    assert grid.shape == (2, 50)
    assert grid.min() >= 0 and grid.max() <= M32


def test_int32_bit_patterns_and_int64_words_agree() -> None:
    prefix = torch.tensor([[0], [M32], [2**31]])
    tokens = torch.arange(4096)
    bits = murmur3_finish_bits(prefix, tokens)
    words = murmur3_finish(prefix, tokens)
    assert bits.dtype == torch.int32 and words.dtype == torch.int64
    assert torch.equal(bits.to(torch.int64) & M32, words)
    assert bool((bits < 0).any())  # high words really take the sign bit
    assert torch.equal(
        uniform_from_bits(bits).view(torch.int32), uniform_from_bits(words).view(torch.int32)
    )
