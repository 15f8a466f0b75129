"""Offload lookups for sliding-window groups: the scanner and the window coverage.

A sliding-window layer at position p only reads the last `window` tokens, so a prefix hit of L
chunks needs only the chunks covering the window before L, not the whole prefix. Two rules
(CONTRACTS.md, KV offload tier):

Coverage. With speculative decoding a group also retains `extra_retained` tokens beyond the
window (drafts may be rejected and roll back), so the chunks a hit must have are
    coverage = max(cdiv(window, chunk), cdiv(window - 1 + extra_retained, chunk)).
The "- 1" is because the window includes the current token: one retained token costs no extra
chunk. The same coverage serves the lookup, the "already being loaded" check and the store mask
(which window chunks are worth storing); the store mask gets it from a temporary widened
spec, `WindowSpec.widened_for_store()`, while the real attention window stays as it is.

Scanner. Chunk verdicts are scanned from the end with a run counter: HIT extends the run;
HIT_PENDING (present, write in flight) extends it and marks the current run pending; MISS
resets the run and clears the mark; RETRY (an async probe has not answered) resets the run,
clears the mark and sets a global defer, but the scan goes on so that the probes of the keys
further left start in this same step. When a run reaches the coverage: defer if the run is
pending or a RETRY was seen, else it is the hit. So a write in flight only blocks the window it
lies in: a complete window elsewhere is still a hit. Without any complete window, the hit falls
back to the leading run from chunk 0 (a prefix shorter than the window needs every chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from services.scheduler.offload.verdict import Verdict

DEFER = None
"""The scanner's answer when the request must ask again next step."""


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def coverage_chunks(window: int, chunk_tokens: int, extra_retained: int = 0) -> int:
    """Chunks a sliding-window hit must hold (see the module docstring)."""
    if window < 1 or chunk_tokens < 1 or extra_retained < 0:
        raise ValueError(
            f"need window >= 1, chunk_tokens >= 1, extra_retained >= 0; got {window}, "
            f"{chunk_tokens}, {extra_retained}"
        )
    return max(cdiv(window, chunk_tokens), cdiv(window - 1 + extra_retained, chunk_tokens))


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """The part of a sliding-window KV cache spec the offload tier needs."""

    window: int  # tokens attended to, the current one included
    extra_retained: int = 0  # tokens kept beyond the window for speculative decoding

    def coverage(self, chunk_tokens: int) -> int:
        return coverage_chunks(self.window, chunk_tokens, self.extra_retained)

    def widened_for_store(self) -> WindowSpec:
        """A temporary spec whose plain window covers the retained tokens too, for the store
        mask only. Its coverage equals this spec's: max(w, w - 1 + r) tokens, no retention."""
        return replace(
            self, window=max(self.window, self.window - 1 + self.extra_retained), extra_retained=0
        )


def window_chunks(end_chunk: int, coverage: int) -> range:
    """The chunks a hit of `end_chunk` chunks needs: the last `coverage` ones (or all of them
    when the prefix is shorter than the coverage). The lookup and the "already being loaded"
    check use this range."""
    return range(max(0, end_chunk - coverage), end_chunk)


def store_mask(num_chunks: int, spec: WindowSpec, chunk_tokens: int) -> list[bool]:
    """Which of a request's `num_chunks` full chunks are worth storing for a window group: the
    ones a later hit at the end of this prefix would need."""
    needed = window_chunks(num_chunks, spec.widened_for_store().coverage(chunk_tokens))
    return [i in needed for i in range(num_chunks)]


def scan_sliding_window(
    verdict_of: Callable[[int], Verdict] | Sequence[Verdict], num_chunks: int, coverage: int
) -> int | None:
    """The hit length in chunks (0 = no hit), or DEFER. `verdict_of(i)` is asked lazily, right
    to left, and only as far as the scan goes: asking is what starts an async probe."""
    if coverage < 1:
        raise ValueError(f"coverage must be >= 1, got {coverage}")
    get = verdict_of.__getitem__ if isinstance(verdict_of, Sequence) else verdict_of
    verdicts: dict[int, Verdict] = {}
    run = 0
    run_pending = False
    defer = False
    for i in range(num_chunks - 1, -1, -1):
        verdict = verdicts[i] = get(i)
        if verdict is Verdict.HIT or verdict is Verdict.HIT_PENDING:
            run += 1
            run_pending |= verdict is Verdict.HIT_PENDING
        else:
            run = 0
            run_pending = False
            defer |= verdict is Verdict.RETRY
            continue
        if run == coverage:
            return DEFER if run_pending or defer else i + coverage
    if defer:
        return DEFER
    leading = 0
    while leading < num_chunks and verdicts[leading] in (Verdict.HIT, Verdict.HIT_PENDING):
        if verdicts[leading] is Verdict.HIT_PENDING:
            return DEFER
        leading += 1
    return leading
