"""LRU eviction with logical ranks and a lazy heap.

Recency is a rank from a counter: every touch (and every insertion) gives a key the next rank;
the least recent evictable key has the smallest rank. Ranks are separate from pinning: a chunk
pinned by a reader keeps its rank, and when the last reader leaves it re-enters the evictable
set with that rank — not as if it had been used at unpin time, which would let transfer timing
(not requests) decide the order.

The evictable set is a min-heap of (rank, key) entries maintained lazily: an entry is pushed
whenever a key becomes evictable or gets a new rank while evictable, and never removed in
place. An entry is stale when its key is gone, not evictable, or has a different rank now;
stale entries are skipped when met. Invariants: every evictable key has a live entry (its
current rank) in the heap, and the heap never holds more than max(64, 2 x evictable count)
entries: it is rebuilt from the evictable keys whenever a push, pin or removal would break
that, so heavy re-ranking cannot grow it without bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence

from services.kvstore.chunk_table import Key
from services.kvstore.policy import OffloadPolicy

MIN_HEAP_BOUND = 64


class LRUPolicy(OffloadPolicy):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._clock = 0
        self.rank: dict[Key, int] = {}
        self._heap: list[tuple[int, Key]] = []
        self.heap_rebuilds = 0

    @property
    def heap_size(self) -> int:
        return len(self._heap)

    def touch(self, keys: Sequence[Key]) -> None:
        for key in keys:
            if key in self.rank:
                self._rerank(key)

    def on_inserted(self, key: Key) -> None:
        self._rerank(key)

    def on_evictable(self, key: Key) -> None:
        self._push(key)

    def on_removed(self, key: Key) -> None:
        del self.rank[key]
        self._bound()

    def pin(self, key: Key) -> bool:
        pinned = super().pin(key)
        self._bound()  # a pin shrinks the evictable set, and so the heap's bound
        return pinned

    def select_victims(self, n: int, nbytes: int, protected: Collection[Key]) -> list[Key] | None:
        """Pops live entries smallest rank first and pushes every one back: selection leaves
        all live entries in place (only stale ones are discarded), so a failed or partial
        selection changes nothing that matters, and the caller's removals make the chosen
        entries stale."""
        protected_evictable = sum(1 for k in protected if self.table.is_evictable(k))
        if self.table.evictable_count - protected_evictable < n:
            return None  # fast refusal: cannot reach n whatever the order
        chosen: list[Key] = []
        popped: list[tuple[int, Key]] = []
        freed = 0
        while (len(chosen) < n or freed < nbytes) and self._heap:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            if self.rank.get(key) != rank or not self.table.is_evictable(key):
                continue  # stale: dropped for good
            popped.append(entry)
            if key not in protected:
                chosen.append(key)
                freed += self.table.nbytes(key)
        for entry in popped:
            heapq.heappush(self._heap, entry)
        return chosen if len(chosen) >= n and freed >= nbytes else None

    def _rerank(self, key: Key) -> None:
        self._clock += 1
        self.rank[key] = self._clock
        if self.table.is_evictable(key):
            self._push(key)

    def _push(self, key: Key) -> None:
        heapq.heappush(self._heap, (self.rank[key], key))
        self._bound()

    def _bound(self) -> None:
        if len(self._heap) > max(MIN_HEAP_BOUND, 2 * self.table.evictable_count):
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self.rank[k], k) for k in self.rank if self.table.is_evictable(k)]
        heapq.heapify(self._heap)
        self.heap_rebuilds += 1
