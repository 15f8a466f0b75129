"""Uniforms from hash bits: the split-16 float32 map and the 53-bit float64 variant."""

from __future__ import annotations

import torch

from meshllm_kernels.sampling.murmur3 import (
    ONE_BELOW_F32,
    ONE_BELOW_F64,
    murmur3_words,
    split_seed,
    uniform32,
    uniform64,
    uniform64_from_bits,
    uniform_from_bits,
)

EDGE_WORDS = [
    0, 1, 2, 0xFFFF, 0x10000, 0x10001, 0x7FFFFFFF, 0x80000000, 0xFFFF0000, 0xFFFEFFFF,
    2**32 - 129, 2**32 - 128, 2**32 - 127, 2**32 - 2, 0xFFFFFFFF,
]  # fmt: skip


def correctly_rounded_f32(r: torch.Tensor) -> torch.Tensor:
    """fp32(nearest) of (r + 0.5) / 2^32: 2r + 1 (33 bits) is exact in float64, the scaling by
    2^-33 is exact, and the cast to float32 rounds once to nearest even."""
    return ((2 * r + 1).to(torch.float64) * 2.0**-33).to(torch.float32)


def test_split16_is_the_correctly_rounded_value_over_a_million_words() -> None:
    gen = torch.Generator().manual_seed(1)
    r = torch.randint(0, 2**32, (1 << 20,), generator=gen, dtype=torch.int64)
    r = torch.cat([r, torch.tensor(EDGE_WORDS, dtype=torch.int64)])
    u = uniform_from_bits(r)
    expected = correctly_rounded_f32(r)
    # Words whose correctly rounded value is 1.0 are mapped to the largest float below 1.
    expected = torch.where(expected == 1.0, torch.tensor(ONE_BELOW_F32), expected)
    assert u.dtype == torch.float32
    assert torch.equal(u.view(torch.int32), expected.view(torch.int32))
    assert bool((u > 0).all()) and bool((u < 1).all())


def test_split16_edges_and_the_exact_set_mapped_below_one() -> None:
    r = torch.tensor(EDGE_WORDS, dtype=torch.int64)
    u = uniform_from_bits(r)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert u[0].item() == 2.0**-33  # smallest: half a step above 0
    assert u[1].item() == 1.5 * 2.0**-32
    # The top 128 words round to 1.0 exactly; everything else keeps its correct rounding.
    top = torch.arange(2**32 - 1024, 2**32, dtype=torch.int64)
    rounded_to_one = correctly_rounded_f32(top) == 1.0
    assert int(rounded_to_one.sum()) == 128
    assert bool(rounded_to_one[-128:].all())
    assert bool((uniform_from_bits(top)[rounded_to_one] == ONE_BELOW_F32).all())


def test_split16_is_monotone_in_the_word() -> None:
    r = torch.arange(0, 2**32, 4099, dtype=torch.int64)
    u = uniform_from_bits(r)
    assert bool((u[1:] >= u[:-1]).all())


def correctly_rounded_f64(r53: torch.Tensor) -> torch.Tensor:
    """fp64(nearest) of (r53 + 0.5) / 2^53: int64 -> float64 rounds 2·r53 + 1 once."""
    return (2 * r53 + 1).to(torch.float64) * 2.0**-54


def test_uniform64_is_correctly_rounded_and_open() -> None:
    gen = torch.Generator().manual_seed(2)
    r1 = torch.randint(0, 2**32, (1 << 20,), generator=gen, dtype=torch.int64)
    r2 = torch.randint(0, 2**32, (1 << 20,), generator=gen, dtype=torch.int64)
    edge = torch.tensor(EDGE_WORDS, dtype=torch.int64)
    r1 = torch.cat([r1, edge, edge.flip(0)])
    r2 = torch.cat([r2, edge, edge])
    u = uniform64_from_bits(r1, r2)
    r53 = (r1 << 21) | (r2 >> 11)
    expected = correctly_rounded_f64(r53)
    expected = torch.where(
        expected == 1.0, torch.tensor(ONE_BELOW_F64, dtype=torch.float64), expected
    )
    assert u.dtype == torch.float64
    assert torch.equal(u, expected)
    assert bool((u > 0).all()) and bool((u < 1).all())
    top = uniform64_from_bits(torch.tensor([0xFFFFFFFF]), torch.tensor([0xFFFFFFFF]))
    assert top.item() == 1.0 - 2.0**-53
    assert uniform64_from_bits(torch.tensor([0]), torch.tensor([0])).item() == 2.0**-54


def test_uniforms_are_keyed_by_seed_position_and_token_only() -> None:
    seeds = torch.tensor([[7], [7], [8], [7]])
    positions = torch.tensor([[3], [3], [3], [4]])
    tokens = torch.arange(64)
    u = uniform32(seeds, positions, tokens)
    assert torch.equal(u[0], u[1])
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[3])
    u64 = uniform64(seeds, positions, tokens)
    # The float64 variant refines the float32 one: same leading 32 bits of randomness.
    assert torch.allclose(u64.float(), u, rtol=0, atol=2.0**-24)
    assert torch.equal(u64[0], u64[1])


def test_uniform32_moments_and_hash_bits_look_uniform() -> None:
    seeds = torch.arange(64).reshape(-1, 1)
    u = uniform32(seeds, torch.tensor([[5]]), torch.arange(16384)).double().flatten()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 4 * (1 / 180 / n) ** 0.5
    # Every one of the 32 hash bits is set about half the time.
    lo, hi = split_seed(seeds)
    r = murmur3_words(lo, hi, torch.tensor([[5]]), torch.arange(16384)).flatten()
    for bit in range(32):
        frac = ((r >> bit) & 1).double().mean().item()
        assert abs(frac - 0.5) < 4 * (0.25 / n) ** 0.5, bit
