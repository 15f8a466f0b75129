"""What one request did with the offload tier, kept until it finishes.

Recency is committed once per request, never per step (CONTRACTS.md, KV offload tier). While a
request runs, the scheduler records every offload key it loaded or offered for store with the
key's end position (the token count its prefix covers). When the request finishes, the policy
gets ONE access: the keys ordered tail first, head last, across all KV cache groups, merged by
position. Applied in that order by `touch`, the head of a prefix ends most recent and is evicted
last, so eviction never leaves a cached suffix without its head. The order comes from positions,
not from when transfers completed, so transfer completion order cannot change it.

Each key is also classified for the policy and for metrics:
- inserted: this request's store put the chunk in the tier;
- reused: a ready chunk this request actually read (a load that pinned it);
- store miss: offered for store while absent. The policy's store-miss hook runs once per key per
  request, before the insertion; `first_store_miss` is how the caller knows it is the first.
Internal reads that move data between tiers are not accesses and are never recorded here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kvstore.chunk_table import Key


@dataclass
class RequestRecord:
    request_id: str
    # key -> end position; insertion-ordered, which breaks position ties deterministically.
    positions: dict[Key, int] = field(default_factory=dict)
    inserted: set[Key] = field(default_factory=set)
    reused: set[Key] = field(default_factory=set)
    store_misses: set[Key] = field(default_factory=set)

    def _record(self, key: Key, end: int) -> None:
        if end <= 0:
            raise ValueError(f"end position must be > 0, got {end} for {key!r}")
        # The same key always names the same prefix, so its end position is fixed; keep the
        # largest in case a caller reports a chunk start by mistake on a later call.
        self.positions[key] = max(end, self.positions.get(key, 0))

    def offered(self, key: Key, end: int) -> None:
        """The request offered `key` for store (present or not)."""
        self._record(key, end)

    def first_store_miss(self, key: Key) -> bool:
        """Note that `key` was absent when offered; True only the first time for this request,
        when the caller must call the policy's store-miss hook."""
        if key in self.store_misses:
            return False
        self.store_misses.add(key)
        return True

    def was_inserted(self, key: Key) -> None:
        self.inserted.add(key)

    def was_read(self, key: Key, end: int) -> None:
        """The request read `key` (a ready chunk it pinned)."""
        self._record(key, end)
        self.reused.add(key)

    def access_order(self) -> list[Key]:
        """The request's keys, tail first and head last (largest end position first); equal
        positions (the same prefix in several groups) keep their recording order."""
        return sorted(self.positions, key=lambda k: -self.positions[k])

    def summary(self) -> dict[str, int]:
        return {
            "keys": len(self.positions),
            "inserted": len(self.inserted),
            "reused": len(self.reused),
            "store_misses": len(self.store_misses),
        }
