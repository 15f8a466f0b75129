"""The offload hit of a model with sliding-window groups (alone or next to full attention).

A full-attention group serves a hit of L chunks only if it has every chunk below L; a
sliding-window group needs only the chunks of its window coverage ending at L
(services.scheduler.offload.window_scan: `coverage_chunks`, widened by the tokens retained for
speculation). So the hit is the largest L such that:
- every full group has every chunk in [first, L) in the tier (below `first`, the local prefix
  hit holds them);
- every sliding group has the chunks `window_chunks(L, coverage)`: those at or after `first` in
  the tier, those before `first` in its local hit table (a null entry there is a miss: the
  local cache dropped it, and a load only appends blocks after the local hit).

Full groups give an upper bound E (their leading run); each sliding group is scanned right to
left below the current bound (`scan_sliding_window`: a pending chunk only blocks its own
window, a RETRY defers), and the bound shrinks to its answer. A sliding group's hit at a shorter
length is a different question, so the scans repeat until no group shortens L (the same fixed
point as KVCacheCoordinator.find_longest_cache_hit). L never grows, so this terminates.

What is loaded: full groups every chunk in [first, L); sliding groups only their window's
chunks at or after `first`. The sliding group's table entries before its window are the null
block (as SlidingWindowManager leaves them), so the allocation takes exactly the loaded blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.scheduler.offload.verdict import Verdict
from services.scheduler.offload.window_scan import (
    DEFER,
    WindowSpec,
    scan_sliding_window,
    store_mask,
    window_chunks,
)

VerdictOf = Callable[[int, int], Verdict]
"""(chunk index, group) -> the tier's verdict; asking starts the async probe."""


@dataclass(frozen=True, slots=True)
class GroupWindow:
    """One prefix-cacheable group as the offload tier sees it."""

    group: int
    spec: WindowSpec | None = None  # None: full attention
    chunk_tokens: int = 1

    @classmethod
    def sliding(
        cls, group: int, window: int, chunk_tokens: int, extra_retained: int = 0
    ) -> GroupWindow:
        return cls(group, WindowSpec(window, extra_retained), chunk_tokens)

    @property
    def coverage(self) -> int | None:
        """Chunks a hit needs, ending at it (its window and retained tokens); None: all."""
        return None if self.spec is None else self.spec.coverage(self.chunk_tokens)

    def chunks(self, first: int, end: int) -> range:
        """The chunks of a hit of `end` chunks this group loads (those at or after `first`):
        the same range for the lookup and the "already being loaded" check."""
        if self.spec is None:
            return range(first, end)
        window = window_chunks(end, self.spec.coverage(self.chunk_tokens))
        return range(max(first, window.start), end)

    def worth_storing(self, num_chunks: int) -> list[bool]:
        """Which of a request's first `num_chunks` chunks a later hit at their end would read:
        all of them for full attention, the store mask of the widened window for a sliding
        group (window_scan.store_mask)."""
        if self.spec is None:
            return [True] * num_chunks
        return store_mask(num_chunks, self.spec, self.chunk_tokens)


def window_hit(
    groups: Sequence[GroupWindow],
    verdict_of: VerdictOf,
    first: int,
    cap: int,
    local_has: Callable[[int, int], bool],
) -> int | None:
    """The hit length in chunks (<= first: nothing to load), or DEFER (an unanswered probe, or
    a write in flight, in the way). `local_has(i, g)`: the local hit holds chunk i < first of
    group g."""
    end = cap
    full = [w.group for w in groups if w.coverage is None]
    for i in range(first, cap):
        verdicts = [verdict_of(i, g) for g in full]
        if any(v is Verdict.RETRY or v is Verdict.HIT_PENDING for v in verdicts):
            return DEFER
        if any(v is Verdict.MISS for v in verdicts):
            end = i
            break
    sliding = [w for w in groups if w.coverage is not None]
    if end <= first or not sliding:
        return end
    while True:
        agreed = end
        for window in sliding:
            g = window.group

            def verdict(i: int, g: int = g) -> Verdict:
                if i >= first:
                    return verdict_of(i, g)
                return Verdict.HIT if local_has(i, g) else Verdict.MISS

            coverage = window.coverage
            assert coverage is not None
            hit = scan_sliding_window(verdict, agreed, coverage)
            if hit is DEFER:
                return DEFER
            agreed = min(agreed, hit)
        if agreed == end or agreed <= first:
            return agreed
        end = agreed
