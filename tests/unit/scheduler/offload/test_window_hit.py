"""The offload hit across full-attention and sliding-window groups (`window_hit`), pure."""

from __future__ import annotations

from services.scheduler.offload.verdict import Verdict
from services.scheduler.offload.window_hit import GroupWindow, window_hit
from services.scheduler.offload.window_scan import DEFER

H, P, M, R = Verdict.HIT, Verdict.HIT_PENDING, Verdict.MISS, Verdict.RETRY
FULL = GroupWindow(0)
SLIDE = GroupWindow.sliding(1, window=2, chunk_tokens=1)


def table(*per_group: list[Verdict]):  # type: ignore[no-untyped-def]
    """verdict_of over one verdict list per group (group g = list g); records what was asked."""
    asked: list[tuple[int, int]] = []

    def verdict_of(i: int, g: int) -> Verdict:
        asked.append((i, g))
        return per_group[g][i]

    return verdict_of, asked


def no_local(i: int, g: int) -> bool:
    raise AssertionError(f"chunk {i} of group {g} is not below the local hit")


def test_the_hit_ends_where_the_full_groups_and_the_window_agree() -> None:
    verdict_of, _ = table([H] * 6, [M, M, M, M, H, H])
    assert window_hit([FULL, SLIDE], verdict_of, 0, 6, no_local) == 6
    # the window's last chunk is missing: the hit ends at the complete window before it
    verdict_of, _ = table([H] * 6, [M, M, H, H, M, M])
    assert window_hit([FULL, SLIDE], verdict_of, 0, 6, no_local) == 4
    # a full group's miss bounds the hit; the window is then asked below that bound only
    verdict_of, asked = table([H, H, H, M, H, H], [H] * 6)
    assert window_hit([FULL, SLIDE], verdict_of, 0, 6, no_local) == 3
    assert {i for i, g in asked if g == 1} == {1, 2}


def test_a_pending_chunk_only_blocks_its_own_window() -> None:
    verdict_of, _ = table([H] * 4, [H, H, M, P])
    assert window_hit([FULL, SLIDE], verdict_of, 0, 4, no_local) == 2  # not deferred
    verdict_of, _ = table([H] * 4, [P, H, M, H])
    assert window_hit([FULL, SLIDE], verdict_of, 0, 4, no_local) is DEFER


def test_any_retry_in_the_way_defers() -> None:
    verdict_of, _ = table([H] * 4, [H, H, R, H])
    assert window_hit([FULL, SLIDE], verdict_of, 0, 4, no_local) is DEFER
    verdict_of, _ = table([H, R, H, H], [H] * 4)  # a full group's unanswered chunk
    assert window_hit([FULL, SLIDE], verdict_of, 0, 4, no_local) is DEFER


def test_chunks_below_the_local_hit_come_from_the_local_table() -> None:
    # local hit of 2 chunks; the window of a hit at 3 needs chunk 1 (local) and 2 (tier)
    local = {(0, 1): False, (1, 1): True}
    verdict_of, asked = table([H] * 4, [M, M, H, M])
    got = window_hit([FULL, SLIDE], verdict_of, 2, 4, lambda i, g: local[i, g])
    assert got == 3 and all(i >= 2 for i, _ in asked)  # the tier is never asked below first
    local[1, 1] = False  # the local cache dropped it: no window ends at 3
    verdict_of, _ = table([H] * 4, [M, M, H, M])
    assert window_hit([FULL, SLIDE], verdict_of, 2, 4, lambda i, g: local[i, g]) == 0


def test_two_windows_iterate_to_a_length_both_serve() -> None:
    narrow, wide = GroupWindow.sliding(0, 1, 1), GroupWindow.sliding(1, 3, 1)
    # narrow's best end is 6; wide has no window ending at 6 but one ending at 4;
    # at 4 narrow needs chunk 3, which it lacks: it answers 3; wide at 3 has chunks 0..2.
    verdict_of, _ = table([M, M, H, M, M, H], [H, H, H, H, M, M])
    assert window_hit([narrow, wide], verdict_of, 0, 6, no_local) == 3


def test_loaded_chunks_per_group() -> None:
    assert FULL.chunks(1, 6) == range(1, 6)
    assert SLIDE.chunks(1, 6) == range(4, 6)
    assert SLIDE.chunks(1, 2) == range(1, 2)  # the rest of the window is the local hit
    assert GroupWindow.sliding(1, window=32, chunk_tokens=16, extra_retained=3).coverage == 3
    assert GroupWindow.sliding(1, window=32, chunk_tokens=16, extra_retained=1).coverage == 2
