"""The acceptance rule: drafts stand while they equal the target's draws; then its draw."""

from __future__ import annotations

from services.worker.spec.verify import accepted_tokens, num_accepted


def test_all_drafts_accepted_then_the_bonus() -> None:
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]


def test_first_mismatch_is_replaced_by_the_target_draw_and_ends_the_step() -> None:
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 7]) == [8]


def test_no_drafts_is_plain_decoding() -> None:
    assert accepted_tokens([], [3]) == [3]
