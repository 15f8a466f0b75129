"""Sliding-window lookups: a pending chunk only blocks its own window; coverage with retention."""

from __future__ import annotations

import itertools

import pytest

from services.scheduler.offload.window_scan import (
    DEFER,
    Verdict,
    WindowSpec,
    coverage_chunks,
    scan_sliding_window,
    store_mask,
    window_chunks,
)

H, P, R, M = Verdict.HIT, Verdict.HIT_PENDING, Verdict.RETRY, Verdict.MISS


def scan(verdicts: list[Verdict], coverage: int) -> int | None:
    return scan_sliding_window(verdicts, len(verdicts), coverage)


def test_pending_chunk_outside_the_hit_window_does_not_defer() -> None:
    assert scan([H, H, M, P], 2) == 2


def test_pending_chunk_inside_the_hit_window_defers() -> None:
    assert scan([P, H, M, H], 2) is DEFER


@pytest.mark.parametrize("position", range(4))
def test_a_retry_met_before_a_complete_window_defers(position: int) -> None:
    # Every window left of (or through) the RETRY is broken by it or needs its answer.
    checked = 0
    for rest in itertools.product([H, M], repeat=3):
        verdicts = list(rest)
        verdicts.insert(position, R)
        # Only lists where the scan reaches the RETRY: no complete window right of it.
        right = verdicts[position + 1 :]
        if any(right[i] is H and right[i + 1] is H for i in range(len(right) - 1)):
            continue
        assert scan(verdicts, 2) is DEFER, verdicts
        checked += 1
    assert checked >= 5


def test_a_complete_window_right_of_a_retry_is_a_hit() -> None:
    # The scan stops at the first complete window from the end: the chunks left of it are
    # not needed by a sliding-window hit, so their unanswered probes do not matter.
    assert scan([R, H, H, H], 2) == 4


def test_all_hits_give_the_full_length() -> None:
    for n in range(1, 7):
        assert scan([H] * n, 2) == n


def test_run_counter_resets_on_miss_and_takes_the_rightmost_window() -> None:
    assert scan([H, H, H, M, H, H, M], 2) == 6
    assert scan([H, M, H, M, H, M], 2) == 1  # no window: leading run from chunk 0
    assert scan([M, H, H], 3) == 0


def test_without_a_window_the_leading_run_decides() -> None:
    assert scan([H, H], 3) == 2  # shorter than the window: every chunk is needed
    assert scan([H, P], 3) is DEFER  # the leading run holds a write in flight
    assert scan([H, M, P], 3) == 1  # the pending chunk is outside the leading run


def test_the_scan_asks_right_to_left_and_stops_at_the_hit() -> None:
    asked: list[int] = []

    def verdict_of(i: int) -> Verdict:
        asked.append(i)
        return H

    assert scan_sliding_window(verdict_of, 6, 2) == 6
    assert asked == [5, 4]


def test_the_scan_keeps_asking_after_a_retry_so_probes_start() -> None:
    asked: list[int] = []
    verdicts = [H, H, M, R, H]

    def verdict_of(i: int) -> Verdict:
        asked.append(i)
        return verdicts[i]

    assert scan_sliding_window(verdict_of, 5, 2) is DEFER
    assert asked == [4, 3, 2, 1, 0]


# --- coverage: 64-token hit, block 16, window 32, 3 retained tokens ----------------------------

BLOCK = 16
HIT_CHUNKS = 64 // BLOCK


def test_coverage_formula() -> None:
    assert coverage_chunks(32, BLOCK, 0) == 2
    assert coverage_chunks(32, BLOCK, 1) == 2  # one retained token costs no extra chunk
    assert coverage_chunks(32, BLOCK, 2) == 3
    assert coverage_chunks(32, BLOCK, 3) == 3
    assert coverage_chunks(33, BLOCK, 0) == 3
    assert coverage_chunks(1, BLOCK, 0) == 1
    with pytest.raises(ValueError):
        coverage_chunks(0, BLOCK, 0)


@pytest.mark.parametrize(("retained", "checked"), [(3, [3, 2, 1]), (1, [3, 2]), (0, [3, 2])])
def test_lookup_checks_the_chunks_the_retained_tokens_need(retained: int, checked: list) -> None:
    coverage = WindowSpec(32, retained).coverage(BLOCK)
    asked: list[int] = []

    def verdict_of(i: int) -> Verdict:
        asked.append(i)
        return H

    assert scan_sliding_window(verdict_of, HIT_CHUNKS, coverage) == HIT_CHUNKS
    assert asked == checked
    assert list(window_chunks(HIT_CHUNKS, coverage)) == sorted(checked)


def test_missing_chunk_1_refuses_the_64_token_hit_with_3_retained() -> None:
    verdicts = [H, M, H, H]
    assert scan(verdicts, WindowSpec(32, 3).coverage(BLOCK)) == 1  # only the leading run
    assert scan(verdicts, WindowSpec(32, 1).coverage(BLOCK)) == HIT_CHUNKS


def test_chunk_1_being_written_defers_with_3_retained() -> None:
    verdicts = [H, P, H, H]
    assert scan(verdicts, WindowSpec(32, 3).coverage(BLOCK)) is DEFER
    assert scan(verdicts, WindowSpec(32, 1).coverage(BLOCK)) == HIT_CHUNKS


def test_store_mask_stores_chunk_1_only_when_retention_needs_it() -> None:
    assert store_mask(HIT_CHUNKS, WindowSpec(32, 3), BLOCK) == [False, True, True, True]
    assert store_mask(HIT_CHUNKS, WindowSpec(32, 1), BLOCK) == [False, False, True, True]
    assert store_mask(1, WindowSpec(32, 3), BLOCK) == [True]


def test_the_widened_store_spec_leaves_the_attention_window_alone() -> None:
    spec = WindowSpec(32, 3)
    widened = spec.widened_for_store()
    assert (spec.window, spec.extra_retained) == (32, 3)
    assert (widened.window, widened.extra_retained) == (34, 0)
    for window, retained in itertools.product(range(1, 70), range(0, 20)):
        s = WindowSpec(window, retained)
        assert s.widened_for_store().coverage(BLOCK) == s.coverage(BLOCK)
