"""constraint_start and the prompt latch as pure functions (CONTRACTS: the constraint start)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.scheduler.structured_output.reasoning import (
    ReasoningConfig,
    constraint_start,
    reasoning_ended,
)

END = 7  # a one-token reasoning-end marker
A, B = 5, 6  # a two-token marker: `</` `think>`


def start(
    window: list[int],
    history: Sequence[int] = (),
    marker: Sequence[int] = (END,),
    in_play: bool = True,
) -> int:
    return constraint_start(window, history=history, marker=marker, reasoning_in_play=in_play)


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        ([END, 1, 2], 1),  # marker at 0: constrained from the token after it
        ([1, END, 2], 2),  # in the middle
        ([1, 2, END], 3),  # last: only the bonus row is constrained
        ([END, 1, END, 2], 3),  # two markers: the last wins
        ([1, 2, 3], 4),  # none: the sentinel len + 1, nothing constrained, not even the bonus
        ([], 1),  # an empty window: the sentinel too
    ],
)
def test_start_is_after_the_last_marker_or_the_sentinel(window: list[int], expected: int) -> None:
    assert start(window) == expected


def test_not_in_play_is_zero_even_with_a_marker() -> None:
    assert start([1, END, 2], in_play=False) == 0
    assert start([1, END, 2], marker=()) == 0  # no parser


def test_a_marker_spanning_history_and_window_counts_for_the_window() -> None:
    assert start([B, 1, 2], history=[9, A], marker=(A, B)) == 1
    assert start([A, B, 1], history=[9], marker=(A, B)) == 2
    # Completed entirely in the history: already latched, not this window's business.
    assert start([1, 2], history=[A, B], marker=(A, B)) == 3
    # Half a marker is no marker.
    assert start([B, 1], history=[9], marker=(A, B)) == 3
    assert start([B, 1], history=[], marker=(A, B)) == 3


def test_detection_is_stateless() -> None:
    window, history = [1, A, B, 2, A], [A]
    answers = {start(window, history=history, marker=(A, B)) for _ in range(3)}
    assert answers == {3}


@pytest.mark.parametrize(
    ("prompt", "start_marker", "ended"),
    [
        ([1, 2, 3], (), False),  # no marker: the model will reason
        ([1, END, 3], (), True),  # any end marker closes it without a start marker configured
        ([4, 1, END], (4,), True),  # <think> ... </think>: closed
        ([4, END, 4, 1], (4,), False),  # a new think block after an earlier turn's end
        ([END, 4, 1, END], (4,), True),
    ],
)
def test_the_latch_reads_the_prompt(
    prompt: list[int], start_marker: tuple[int, ...], ended: bool
) -> None:
    config = ReasoningConfig(end_token_ids=(END,), start_token_ids=start_marker)
    assert reasoning_ended(prompt, config) is ended


def test_multi_token_markers_in_the_prompt() -> None:
    config = ReasoningConfig(end_token_ids=(A, B))
    assert reasoning_ended([1, A, B, 2], config)
    assert not reasoning_ended([1, A, 2, B], config)
    assert not reasoning_ended([B], config)
