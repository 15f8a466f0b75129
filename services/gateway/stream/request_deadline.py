"""When a request in flight gives up waiting for the engine: two bounds, the first to pass wins.

- total: `request_timeout_s` after the request was accepted, however well it progresses;
- progress: `progress_timeout_s` without a progress signal, i.e. without a reply delta for any
  of its choices (new tokens, or the final one). The clock starts when the request is accepted,
  so the wait for the first token (queueing in the scheduler, prefill) is bounded too: a stuck
  or frozen worker, a scheduler that lost the request, a Redis that stopped answering all end
  the same way, with a clear error instead of a client hanging until the total bound.

The scheduler publishes nothing while a request waits in its queue, so the progress bound also
ends a request that waited that long to be admitted. Continuous batching admits waiting
requests at every step as soon as KV blocks free up, and the gateway sheds load past
`max_pending_requests` with 429 before that, so on a healthy mesh the first token follows in
seconds; a generous default (120 s, past a worker restart with its model load) keeps the bound
for meshes that have stopped making progress. 0 disables it. Pure: times are passed in.
"""

from __future__ import annotations

from typing import Literal

Bound = Literal["total", "progress"]


class RequestDeadline:
    def __init__(self, now: float, total_s: float, progress_s: float) -> None:
        """`progress_s` 0: no progress bound (only the total one)."""
        self.total_at = now + total_s
        self.progress_s = progress_s
        self.progress_at = now + progress_s if progress_s > 0 else float("inf")

    def progressed(self, now: float) -> None:
        """A delta arrived: the progress bound restarts from `now`."""
        if self.progress_s > 0:
            self.progress_at = now + self.progress_s

    def remaining_s(self, now: float) -> float:
        """How long to wait for the next delta (0 once a bound has passed)."""
        return max(0.0, min(self.total_at, self.progress_at) - now)

    def passed(self, now: float) -> Bound | None:
        """Which bound has passed at `now`, None while neither has (total first: a request
        that ran out of its whole time did so however it progressed)."""
        if now >= self.total_at:
            return "total"
        if now >= self.progress_at:
            return "progress"
        return None
