"""Exponential backoff with jitter for reconnecting to Redis.

Delays start at 50 ms and double up to 2 s. Each delay is drawn from [d/2, d]: many consumers that
lost the same Redis at the same moment then spread their reconnects instead of arriving together,
while every delay still grows, so a long outage costs at most one attempt per 2 s per operation.
"""

from __future__ import annotations

import random

BASE_S = 0.05
CAP_S = 2.0


class Backoff:
    """The delays of one retried operation; make a fresh one per operation."""

    def __init__(self, base_s: float = BASE_S, cap_s: float = CAP_S) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.attempts = 0

    def next_delay(self) -> float:
        # The exponent is capped so an outage of any length never overflows the float.
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 30))
        self.attempts += 1
        return random.uniform(ceiling / 2, ceiling)
