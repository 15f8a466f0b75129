"""Monte Carlo tail mass of the sampler at logit gaps of 18 and 20 over a 128k vocabulary.

Setup: token 0 has logit 0, the other V - 1 tokens -gap, T = 1. A tail token wins with the
exact probability p = (V-1)e^-gap / (1 + (V-1)e^-gap) — 2e-3 at gap 18, 2.6e-4 at gap 20 —
and only through noise from the far tail of u (u < ~1e-6), which is what the float32 Gumbel
map must resolve. Counting enough wins by brute force would need ~1e10 hashes.

The test instead enumerates, per draw, exactly the tokens that could win. A tail token j beats
token 0 only if g_j >= g_0 + gap, i.e. only if its hash word r_j is below a bound R (about
2^32·e^-(gap + g_0), ~65 words on average). The Murmur3 finalization, the token round and
the key scrambling are bijections on 32-bit words, so the tokens with r < R are found by
inverting the hash for r = 0 .. R-1 (a check re-hashes them forward). Their noise comes from
the sampler's own functions; every other token provably loses (checked at the bound; g is
monotone in r, test_gumbel.py). A few draws are then replayed
through the real `gumbel_argmax` over the full vocabulary, which must pick the same tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from meshllm_kernels.sampling.gumbel import gumbel_argmax, gumbel_from_uniform
from meshllm_kernels.sampling.murmur3 import (
    C1,
    C2,
    KEY_BYTES,
    MASK32,
    murmur3_finish,
    murmur3_prefix,
    split_seed,
    uniform_from_bits,
)
from tests.unit.worker.sampling.stats import binomial_z

VOCAB = 128_256
DRAWS = 1 << 18
POSITION = 777


def _inv(c: int) -> int:
    return pow(c, -1, 2**32)


def _rotr(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x >> r) | (x << (32 - r))) & MASK32


def _unmix_to_round_input(r: torch.Tensor) -> torch.Tensor:
    """Undo fmix32, the length xor and the round's tail: gives prefix ^ scrambled token word.

    Depends on r only, so it is computed once for all draws.
    """
    h = r ^ (r >> 16)
    h = (h * _inv(0xC2B2AE35)) & MASK32
    h = h ^ (h >> 13) ^ (h >> 26)
    h = (h * _inv(0x85EBCA6B)) & MASK32
    h = (h ^ (h >> 16)) ^ KEY_BYTES
    h = ((h - 0xE6546B64) * _inv(5)) & MASK32
    return _rotr(h, 13)


def _unscramble(k: torch.Tensor) -> torch.Tensor:
    """The token word whose Murmur3 block scrambling gives k."""
    k = (k * _inv(C2)) & MASK32
    return (_rotr(k, 15) * _inv(C1)) & MASK32


def _tail_winners(gap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds [DRAWS], winning token per draw) for logits [0, -gap, ..., -gap] at T = 1."""
    seeds = torch.arange(DRAWS, dtype=torch.int64) * 0x9E3779B97F4A7C15 % 2**61
    seed_lo, seed_hi = split_seed(seeds)
    prefix = murmur3_prefix(seed_lo, seed_hi, torch.tensor(POSITION))
    g_top = gumbel_from_uniform(uniform_from_bits(murmur3_finish(prefix, torch.tensor(0))))
    # Words whose noise could reach g_top + gap (1e-3 of slack over float32 error).
    u_cut = -torch.expm1(-torch.exp(-(g_top.double() + gap - 1e-3)))
    bound = (u_cut * 2**32).ceil().to(torch.int64) + 1
    # The premise, checked on the implementation: the first word left out already loses to
    # token 0, so by the monotonicity of g (test_gumbel.py) every larger word does too.
    first_out = gumbel_from_uniform(uniform_from_bits(bound))
    assert bool((torch.tensor(-gap, dtype=torch.float32) + first_out < g_top).all())
    round_input = _unmix_to_round_input(torch.arange(int(bound.max())))
    best_token = torch.zeros(DRAWS, dtype=torch.int64)
    best_score = g_top.clone()  # token 0's score: logit 0 plus its noise
    for chunk in torch.arange(DRAWS).split(1 << 15):
        # Every (draw, word) pair with word < bound[draw], flattened.
        counts = bound[chunk]
        draw = chunk.repeat_interleave(counts)
        starts = torch.cumsum(counts, 0) - counts
        word = torch.arange(draw.numel()) - starts.repeat_interleave(counts)
        token = _unscramble(round_input[word] ^ prefix[draw])
        live = (token >= 1) & (token < VOCAB)
        draw, token, word = draw[live], token[live], word[live]
        # Forward check of the inversion, then the sampler's own noise and score.
        assert torch.equal(murmur3_finish(prefix[draw], token), word)
        score = torch.tensor(-gap, dtype=torch.float32) + gumbel_from_uniform(
            uniform_from_bits(word)
        )
        # Highest score wins, equal scores go to the smaller id (token 0 included): visit
        # candidates by descending score, then ascending id, and keep the first per draw.
        for i in sorted(range(len(draw)), key=lambda i: (-score[i].item(), token[i].item())):
            d = int(draw[i])
            if score[i] > best_score[d] or (score[i] == best_score[d] and token[i] < best_token[d]):
                best_score[d] = score[i]
                best_token[d] = token[i]
    return seeds, best_token


@pytest.mark.parametrize("gap", [18.0, 20.0])
def test_tail_mass_matches_the_exact_probability(gap: float) -> None:
    seeds, winner = _tail_winners(gap)
    tail_weight = (VOCAB - 1) * math.exp(-gap)
    p_tail = tail_weight / (1 + tail_weight)
    wins = int((winner != 0).sum())
    z = binomial_z(wins, DRAWS, p_tail)
    assert abs(z) < 3, f"gap {gap}: {wins} tail wins, expected {DRAWS * p_tail:.1f} (z={z:.2f})"

    # Replay some draws, tail winners and not, through the real sampler on the full vocabulary.
    won = (winner != 0).nonzero().squeeze(1)[:4]
    lost = (winner == 0).nonzero().squeeze(1)[:2]
    assert won.numel() == 4
    replay = torch.cat([won, lost])
    logits = torch.full((replay.numel(), VOCAB), -gap)
    logits[:, 0] = 0.0
    tokens = gumbel_argmax(
        logits, torch.ones(replay.numel()), seeds[replay], torch.full_like(replay, POSITION)
    )
    assert tokens.tolist() == winner[replay].tolist()
