"""Prefilled requests waiting to be handed to a decode scheduler.

A request is handed off once its prompt KV is in the tier: its job's last step returned and
every store transfer it was given has been answered by the worker (ok or failed: a chunk that
failed is simply recomputed by the decode side, which looks it up like any other). The decode
side could not wait for a write in flight: a chunk being written is a miss to its lookup.

A store answer may never come (the worker died with the write queued; the kvstore then expires
the write): after `max_wait_s` the request is handed off anyway, and the decode side recomputes
what is missing. Handing off early costs compute, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable


class HandoffBook:
    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._since: dict[str, float] = {}  # request id -> when its prefill step returned

    def __len__(self) -> int:
        return len(self._since)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._since

    def request_ids(self) -> list[str]:
        return list(self._since)

    def add(self, request_id: str, now: float) -> None:
        self._since.setdefault(request_id, now)

    def discard(self, request_id: str) -> None:
        self._since.pop(request_id, None)

    def take_ready(self, stores_pending: Callable[[str], bool], now: float) -> list[str]:
        """Requests to hand off now (removed from the book), in prefill order."""
        ready = [
            rid
            for rid, since in self._since.items()
            if not stores_pending(rid) or now - since >= self.max_wait_s
        ]
        for rid in ready:
            del self._since[rid]
        return ready
