"""Gumbel noise and the PyTorch Gumbel-max draw (the CPU sampler and the kernel's reference)."""

from __future__ import annotations

import math

import pytest
import torch

from meshllm_kernels.sampling.gumbel import (
    gumbel_argmax,
    gumbel_from_uniform,
    gumbel_noise,
    log_f32,
    row_argmax,
)
from meshllm_kernels.sampling.murmur3 import uniform_from_bits


def _ulp(x: torch.Tensor) -> torch.Tensor:
    return (torch.nextafter(x.abs(), torch.tensor(math.inf)) - x.abs()).double()


def test_log_f32_within_one_ulp_over_the_normal_range() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.cat(
        [
            torch.logspace(-37.9, 38.3, 200_000, dtype=torch.float64).float(),
            torch.rand(200_000, generator=gen) * 4 + 0.25,
            torch.tensor([1.0, 2.0, 0.5, 0.70710677, 0.70710683, 1.4142135, 2.0**-126]),
        ]
    )
    got = log_f32(x)
    exact = torch.log(x.double())
    err_ulps = (got.double() - exact).abs() / _ulp(got)
    assert err_ulps.max().item() <= 1.0
    assert log_f32(torch.tensor([1.0])).item() == 0.0


def test_gumbel_matches_the_float64_formula() -> None:
    gen = torch.Generator().manual_seed(4)
    r = torch.randint(0, 2**32, (1 << 20,), generator=gen, dtype=torch.int64)
    u = uniform_from_bits(r)
    got = gumbel_from_uniform(u).double()
    exact = -torch.log(-torch.log1p(-u.double()))
    # The degree-8 series is off by <= ~2.3e-6 relative in E at u = 0.25; elsewhere ~ulps.
    assert (got - exact).abs().max().item() < 3e-6


def test_gumbel_tail_keeps_full_resolution_near_zero() -> None:
    # Every word of the far tail, u = (r + 0.5) / 2^32 < 2.5e-4 (g > 8.3): where sampling a
    # token 18-20 logits down is decided, and where a naive float32 log(1 - u) collapses.
    r = torch.arange(0, 1 << 20, dtype=torch.int64)
    u = uniform_from_bits(r)
    g = gumbel_from_uniform(u)
    exact = -torch.log(-torch.log1p(-u.double()))
    assert torch.allclose(g.double(), exact, rtol=3e-7, atol=0)
    assert bool((g[1:] <= g[:-1]).all())  # monotone: a smaller word never gives less noise
    assert bool((g[1:4096] < g[:4095]).all())  # and the first words are all distinct
    assert g[0].item() == pytest.approx(33 * math.log(2), abs=1e-5)  # u = 2^-33
    top = gumbel_from_uniform(uniform_from_bits(torch.tensor([0xFFFFFFFF])))
    assert top.item() == pytest.approx(-math.log(24 * math.log(2)), abs=1e-5)


def _naive(logits: torch.Tensor, inv_t: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor):
    noise = gumbel_noise(seeds, pos, logits.shape[1])
    score = torch.where((inv_t == 0).unsqueeze(1), logits, logits * inv_t.unsqueeze(1) + noise)
    return score.argmax(dim=1)


@pytest.mark.parametrize("spread", [1.0, 5.0, 60.0])  # 60: most tokens pruned (sparse path)
def test_draw_equals_dense_argmax_of_logits_times_inv_t_plus_noise(spread: float) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 4000, generator=gen) * spread
    inv_t = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 3.0, 0.0, 1.0, 1.25, 0.8, 1.0, 1.0])
    seeds = torch.arange(12) * 7919 - 3
    pos = torch.arange(12) + 100
    assert torch.equal(gumbel_argmax(logits, inv_t, seeds, pos), _naive(logits, inv_t, seeds, pos))


def test_greedy_rows_are_plain_argmax_and_ties_go_to_the_smallest_id() -> None:
    logits = torch.randn(3, 500)
    logits[1, 7] = logits[1, 300] = 50.0
    logits[2] = float("-inf")
    inv_t = torch.zeros(3)
    got = gumbel_argmax(logits, inv_t, torch.arange(3), torch.arange(3))
    assert got.tolist() == [int(logits[0].argmax()), 7, 0]
    # Sampled rows: an all -inf row gives 0; a single finite token always wins.
    logits[0] = float("-inf")
    logits[0, 123] = -5.0
    got = gumbel_argmax(logits, torch.ones(3), torch.arange(3), torch.arange(3))
    assert got[0].item() == 123 and got[2].item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_answers_as_torch_argmax(dtype: torch.dtype) -> None:
    """Ties, NaN, all -inf and +inf rows, and plain random rows: the same index as argmax."""
    scores = torch.randn(8, 1000).to(dtype)
    scores[0, [3, 700]] = 9.0  # a tie: the first
    scores[1, [5, 9]] = float("nan")  # NaN counts as the maximum, the first one
    scores[2] = float("-inf")  # nothing finite: 0
    scores[3, [11, 12]] = float("inf")
    scores[4] = 0.0  # all equal: 0
    assert torch.equal(row_argmax(scores), scores.argmax(dim=1))
    assert row_argmax(scores)[:5].tolist() == [3, 5, 0, 11, 0]


def test_bitmask_restricts_the_draw() -> None:
    from meshllm_kernels.sampling.bitmask import pack_bitmask

    logits = torch.zeros(4, 300)
    allowed = torch.zeros(2, 300, dtype=torch.bool)
    allowed[0, [5, 77, 299]] = True
    allowed[1, 260] = True
    index = torch.tensor([0, -1, 1, 0])
    for inv_t in (torch.ones(4), torch.zeros(4)):
        for pos in range(20):
            got = gumbel_argmax(
                logits, inv_t, torch.arange(4), torch.full((4,), pos), pack_bitmask(allowed), index
            )
            assert got[0].item() in (5, 77, 299) and got[3].item() in (5, 77, 299)
            assert got[2].item() == 260


def test_a_row_draws_the_same_token_in_any_batch_and_slot() -> None:
    gen = torch.Generator().manual_seed(6)
    row = torch.randn(1, 3000, generator=gen)
    seed, pos = torch.tensor([2**63 + 11 - 2**64]), torch.tensor([42])
    alone = gumbel_argmax(row, torch.tensor([0.9]), seed, pos)
    others = torch.randn(7, 3000, generator=gen)
    for slot in (0, 3, 7):
        batch = torch.cat([others[:slot], row, others[slot:]])
        seeds = torch.cat([torch.arange(slot), seed, torch.arange(slot, 7) + 50])
        positions = torch.cat([torch.arange(slot), pos, torch.arange(slot, 7)])
        inv_t = torch.cat([torch.ones(slot), torch.tensor([0.9]), torch.zeros(7 - slot)])
        assert gumbel_argmax(batch, inv_t, seeds, positions)[slot] == alone[0]


def test_draw_frequencies_follow_softmax_of_logits_over_t() -> None:
    from tests.unit.worker.sampling.stats import chi_square_pvalue

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 30_000
    for temperature in (1.0, 0.6):
        tokens = gumbel_argmax(
            logits.expand(n, -1),
            torch.full((n,), 1 / temperature),
            torch.arange(n) // 7,
            torch.arange(n) % 7,
        )
        counts = torch.bincount(tokens, minlength=6).double()
        expected = torch.softmax(logits.double() / temperature, dim=0) * n
        assert chi_square_pvalue(counts, expected) > 1e-3
