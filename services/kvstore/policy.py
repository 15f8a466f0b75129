"""The offload policy interface: what every eviction policy of the kvstore implements.

A policy owns the chunk table (status, sizes, pins: identical for every policy, so written once
here) and decides recency and victims (what differs between policies). A subclass writes:
- `touch(keys)`: each key in turn becomes the most recent one, so the LAST key of the call is
  the most recent of all and is evicted last;
- `select_victims(n, nbytes, protected)`: the victims it would evict, without changing anything.
Everything else has a working default:
- `on_request_finished(record)` applies the request's one access by calling `touch` with the
  keys tail first, head last (CONTRACTS.md: recency is committed once per request), so a policy
  that only writes `touch` orders a prefix correctly without knowing about requests;
- `on_store_miss(key)`: called once per key per request, before the key is inserted (a policy
  with ghost lists, like ARC, learns from it); no-op by default;
- `on_inserted`, `on_evictable`, `on_removed`: notifications for policies that index their
  evictable set (the LRU heap).

`evict(n, protected)` is atomic: it evicts exactly n chunks or, when fewer than n unprotected
evictable chunks exist, changes nothing and returns None. Policies are chosen by module path
(`KVStoreSettings.policy`, e.g. "services.kvstore.lru.LRUPolicy") through `load_policy`.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.kvstore.chunk_table import ChunkStatus, ChunkTable, Key

if TYPE_CHECKING:
    from services.kvstore.request_record import RequestRecord


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of offering one chunk for store."""

    inserted: bool  # the caller must now write the payload, then call complete_store
    evicted: list[Key] = field(default_factory=list)  # removed to make room: delete in Redis
    reason: str = ""  # why not inserted: "present", "too_large", "full"


class OffloadPolicy(abc.ABC):
    """Base of every kvstore policy. Not thread-safe: one event loop owns it."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.table = ChunkTable()
        self.evictions = 0

    # --- recency and victims: what a policy decides -------------------------------------------

    @abc.abstractmethod
    def touch(self, keys: Sequence[Key]) -> None:
        """Make each present key, in order, the most recent. Absent keys are ignored."""

    @abc.abstractmethod
    def select_victims(self, n: int, nbytes: int, protected: Collection[Key]) -> list[Key] | None:
        """The fewest evictable, unprotected keys, in eviction order, that number at least `n`
        and hold at least `nbytes`; None when not enough exist. Must not change any state."""

    def on_request_finished(self, record: RequestRecord) -> None:
        self.touch(record.access_order())

    def on_store_miss(self, key: Key) -> None:
        return None

    def on_inserted(self, key: Key) -> None:
        return None

    def on_evictable(self, key: Key) -> None:
        return None

    def on_removed(self, key: Key) -> None:
        return None

    # --- eviction ------------------------------------------------------------------------------

    def evict(self, n: int, protected: Collection[Key] = frozenset()) -> list[Key] | None:
        """Evict exactly `n` chunks, or nothing (None) when fewer are evictable."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        victims = self.select_victims(n, 0, protected)
        if victims is None:
            return None
        self._drop(victims)
        return victims

    def make_room(self, nbytes: int, protected: Collection[Key] = frozenset()) -> list[Key] | None:
        """Evict until `nbytes` more fit under the capacity; [] when they already fit, None (and
        nothing evicted) when they cannot."""
        deficit = self.table.used_bytes + nbytes - self.capacity_bytes
        if deficit <= 0:
            return []
        victims = self.select_victims(0, deficit, protected)
        if victims is None:
            return None
        self._drop(victims)
        return victims

    def _drop(self, victims: Sequence[Key]) -> None:
        for key in victims:
            self.table.remove(key)
            self.on_removed(key)
        self.evictions += len(victims)

    # --- chunk lifecycle -----------------------------------------------------------------------

    def status(self, key: Key) -> ChunkStatus | None:
        return self.table.status(key)

    def begin_store(
        self, key: Key, nbytes: int, protected: Collection[Key] = frozenset()
    ) -> Admission:
        """Reserve room for a new chunk and mark it WRITING; evicts (never `protected` keys)
        when the capacity would be exceeded."""
        if key in self.table:
            return Admission(False, reason="present")
        if nbytes > self.capacity_bytes:
            return Admission(False, reason="too_large")
        evicted = self.make_room(nbytes, protected)
        if evicted is None:
            return Admission(False, reason="full")
        self.table.add(key, nbytes)
        self.on_inserted(key)
        return Admission(True, evicted)

    def complete_store(self, key: Key, ok: bool) -> bool:
        """The payload write finished. A failed write removes the chunk (its bytes are freed);
        False when the key was not being written."""
        if self.table.status(key) is not ChunkStatus.WRITING:
            return False
        if ok:
            self.table.mark_ready(key)
            self.on_evictable(key)
        else:
            self.table.remove(key)
            self.on_removed(key)
        return True

    def restore(self, key: Key, nbytes: int) -> bool:
        """Re-register a ready chunk found in Redis (kvstore restart); it becomes the most
        recent. False when it is present already or does not fit."""
        if key in self.table or self.table.used_bytes + nbytes > self.capacity_bytes:
            return False
        self.table.add(key, nbytes, ready=True)
        self.on_inserted(key)
        self.on_evictable(key)
        return True

    def pin(self, key: Key) -> bool:
        """A reader starts; False when the chunk is absent or still being written."""
        return self.table.pin(key)

    def unpin(self, key: Key) -> None:
        if self.table.unpin(key):
            self.on_evictable(key)


class EvictionOrderPolicy(OffloadPolicy, abc.ABC):
    """Helper base for policies that can list their evictable keys in eviction order: victim
    selection (counts, bytes, protection, atomicity) is then written once, here."""

    @abc.abstractmethod
    def eviction_order(self) -> Sequence[Key]:
        """Every key, first victim first (non-evictable keys are skipped by the caller)."""

    def select_victims(self, n: int, nbytes: int, protected: Collection[Key]) -> list[Key] | None:
        chosen: list[Key] = []
        freed = 0
        for key in self.eviction_order():
            if len(chosen) >= n and freed >= nbytes:
                break
            if key in protected or not self.table.is_evictable(key):
                continue
            chosen.append(key)
            freed += self.table.nbytes(key)
        return chosen if len(chosen) >= n and freed >= nbytes else None


def load_policy(path: str, capacity_bytes: int) -> OffloadPolicy:
    """Build the policy class named by `module.path.ClassName`."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"policy must be 'module.path.ClassName', got {path!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load policy {path!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, OffloadPolicy)):
        raise ValueError(f"policy {path!r} is not an OffloadPolicy subclass")
    return cls(capacity_bytes)
