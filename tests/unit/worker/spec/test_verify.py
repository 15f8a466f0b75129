"""The acceptance rules: point-mass drafts stand while they equal the target's draws (then its
draw); sampled drafts by rejection sampling (u·q < p, then the residual max(0, p - q))."""

from __future__ import annotations

import torch

from meshllm_kernels.sampling.gumbel import gumbel_argmax
from services.worker.spec.verify import (
    accept_mask,
    accepted_tokens,
    chain_tokens,
    num_accepted,
    residual_scores,
)


def test_all_drafts_accepted_then_the_bonus() -> None:
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]


def test_first_mismatch_is_replaced_by_the_target_draw_and_ends_the_step() -> None:
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 7]) == [8]


def test_no_drafts_is_plain_decoding() -> None:
    assert accepted_tokens([], [3]) == [3]


# -- rejection sampling (sampled drafts) --------------------------------------------------


def test_a_draft_is_accepted_iff_u_times_q_is_below_p() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.6, 0.2], [0.9, 0.05, 0.05]])
    drafts = torch.tensor([0, 1, 0])
    # row 0: p >= q, always accepted; row 1: ratio 0.5; row 2: ratio 1/9
    u = torch.tensor([0.99, 0.49, 0.12])
    assert accept_mask(p, q, drafts, u).tolist() == [True, True, False]
    assert accept_mask(p, q, drafts, torch.tensor([0.5, 0.51, 0.1])).tolist() == [
        True,
        False,
        True,
    ]


def test_the_residual_draws_only_where_p_exceeds_q() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.6, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    scores, has_mass = residual_scores(p, q)
    assert has_mass.tolist() == [True, False]  # p == q leaves nothing to correct with
    assert torch.isfinite(scores[0]).tolist() == [True, False, False, False]
    # Gumbel-max over the scores samples max(0, p - q) normalised: here token 0, always.
    seeds = torch.arange(2000)
    draws = gumbel_argmax(scores[:1].expand(2000, -1), torch.ones(2000), seeds, seeds)
    assert set(draws.tolist()) == {0}


def test_the_residual_has_the_normalised_excess_distribution() -> None:
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    q = torch.tensor([0.3, 0.1, 0.3, 0.3])  # the excess is on token 1 alone
    q2 = torch.tensor([0.4, 0.2, 0.2, 0.2])  # excess 0.2 on token 1, 0.1 on token 2
    for qq, expected in ((q, [0, 1, 0, 0]), (q2, [0, 2 / 3, 1 / 3, 0])):
        scores, _ = residual_scores(p[None], qq[None])
        n = 30_000
        seeds = torch.full((n,), 7)
        draws = gumbel_argmax(scores.expand(n, -1), torch.ones(n), seeds, torch.arange(n))
        freq = torch.bincount(draws, minlength=4).double() / n
        assert torch.allclose(freq, torch.tensor(expected, dtype=torch.float64), atol=0.015)


def test_the_chain_stops_at_the_first_rejection() -> None:
    drafts = [4, 5, 6]
    corrections = [40, 50, 60, 70]
    assert chain_tokens(drafts, [True, True, True, True], corrections, bonus=7) == [4, 5, 6, 7]
    assert chain_tokens(drafts, [True, False, True], corrections, bonus=7) == [4, 50]
    assert chain_tokens(drafts, [False, True, True], corrections, bonus=7) == [40]
    assert chain_tokens([], [], [], bonus=7) == [7]


def test_the_proposals_draft_past_the_plan_is_checked_at_the_last_row() -> None:
    """The plan carried 2 of the proposal's drafts; the third is checked at row 2: accepted it
    ends the output (no logits after it), rejected its correction does; the bonus is unused."""
    drafts = [4, 5]
    corrections = [40, 50, 60]
    assert chain_tokens(drafts, [True, True, True], corrections, bonus=7, extra=6) == [4, 5, 6]
    assert chain_tokens(drafts, [True, True, False], corrections, bonus=7, extra=6) == [4, 5, 60]
    assert chain_tokens(drafts, [True, False, True], corrections, bonus=7, extra=6) == [4, 50]
    assert chain_tokens([], [False], [30], bonus=7, extra=3) == [30]
