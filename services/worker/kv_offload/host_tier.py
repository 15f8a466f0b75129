"""The worker's private host-memory tier in front of Redis: a bounded LRU of chunk payloads.

Values are the exact payload bytes written to (or read from) Redis under the same key, so a
host hit is validated like a Redis hit and the two tiers can never disagree on a chunk's layout.
A payload key names a token prefix of one model and layout, and the KV of a prefix does not
change, so a copy kept here after the kvstore evicted the Redis key is still correct; the
scheduler only asks for keys the kvstore lists, so it is simply not asked for.

Thread-safe: the store thread inserts, the load thread reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class HostTier:
    """Invariant: `nbytes` (sum of the held values' lengths) never exceeds `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str) -> bytes | None:
        """The value, now the most recently used; None on a miss."""
        with self._lock:
            value = self._values.get(key)
            if value is None:
                self.misses += 1
                return None
            self._values.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: str, value: bytes) -> bool:
        """Insert (or refresh) `key`, evicting least recently used values until it fits.
        A value larger than the whole tier is not kept (False)."""
        size = len(value)
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self.nbytes -= len(old)
            if size > self.capacity_bytes:
                return False
            while self.nbytes + size > self.capacity_bytes:
                _, evicted = self._values.popitem(last=False)
                self.nbytes -= len(evicted)
            self._values[key] = value
            self.nbytes += size
            return True

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.nbytes = 0
