"""What the offload tier says about one chunk (CONTRACTS.md, background vocabulary)."""

from __future__ import annotations

from enum import Enum


class Verdict(Enum):
    HIT = "hit"  # present and readable now
    HIT_PENDING = "hit_pending"  # present, its write still in flight: ask again next step
    RETRY = "retry"  # an async probe has not answered yet
    MISS = "miss"


READY_STATUSES = frozenset({"ready", "pinned"})


def verdict_of_status(status: str) -> Verdict:
    """A kvstore chunk status ("ready", "pinned", "writing", "missing") as a lookup verdict
    (RETRY is the caller's: no answer yet)."""
    if status in READY_STATUSES:
        return Verdict.HIT
    return Verdict.HIT_PENDING if status == "writing" else Verdict.MISS
