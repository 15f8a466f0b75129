"""The kvstore's core: a policy plus one record per running request.

This is where the lifecycle of CONTRACTS.md's offload tier is put together, free of I/O (the
service maps it to bus calls and Redis):
- `store`: a request offers chunks; absent ones get the store-miss hook (once per key per
  request, before insertion), then are inserted WRITING (evicting others when over capacity,
  never the request's own keys) and returned for the worker to write;
- `stored`: the writes finished (ready) or failed (removed);
- `load`: a holder pins ready chunks to read them; a request's loads are recorded as reuse,
  an internal tier-to-tier move (`internal=True`) is not an access and records nothing;
- `loaded`: the reads finished (unpinned; the chunk keeps its rank);
- `request_finished`: the request's one access goes to the policy; pins it still holds are
  released, so a lost `loaded` cannot pin a chunk forever.
Pins are counted per holder, so releasing twice (a retried `loaded`, then the finish) never
unpins a chunk held by someone else. A write that never reports back (its worker died) would
hold its bytes forever: `expire_writes` fails writes older than a deadline. Two deadlines: a
write whose step is still running (offered by `store`, not yet `writes_started`) waits for a
forward of unknown length, so it gets the long one; once `writes_started` says the step ended
(the worker is writing now) the short one runs from then, covering only the writes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.kvstore.chunk_table import ChunkStatus, Key
from services.kvstore.policy import OffloadPolicy
from services.kvstore.request_record import RequestRecord


@dataclass(frozen=True, slots=True)
class ChunkOffer:
    key: Key
    end: int  # tokens covered by the prefix this chunk ends
    nbytes: int


@dataclass
class StorePlan:
    write: list[Key] = field(default_factory=list)  # inserted WRITING: write these payloads
    present: list[Key] = field(default_factory=list)  # already held: nothing to write
    refused: list[Key] = field(default_factory=list)  # no room (everything else pinned/protected)
    evicted: list[Key] = field(default_factory=list)  # removed to make room: delete in Redis


class OffloadTier:
    def __init__(self, policy: OffloadPolicy) -> None:
        self.policy = policy
        self.records: dict[str, RequestRecord] = {}
        self._pins: dict[str, Counter[Key]] = {}
        self._writing_since: dict[Key, float] = {}
        self._started: set[Key] = set()  # writing keys whose step ended (writes_started)

    def _record(self, request_id: str) -> RequestRecord:
        record = self.records.get(request_id)
        if record is None:
            record = self.records[request_id] = RequestRecord(request_id)
        return record

    def lookup(self, keys: Iterable[Key]) -> list[ChunkStatus | None]:
        """Status of each key (None: absent). A lookup is not an access: recency changes only
        when a request finishes."""
        return [self.policy.status(k) for k in keys]

    def store(self, request_id: str, offers: Sequence[ChunkOffer], now: float = 0.0) -> StorePlan:
        record = self._record(request_id)
        for offer in offers:
            record.offered(offer.key, offer.end)
        # The request's own keys (its head, already stored or loaded) are never evicted to make
        # room for its tail: a suffix without its head is useless.
        protected = record.positions.keys()
        plan = StorePlan()
        for offer in offers:
            if self.policy.status(offer.key) is not None:
                plan.present.append(offer.key)
                continue
            if record.first_store_miss(offer.key):
                self.policy.on_store_miss(offer.key)
            admission = self.policy.begin_store(offer.key, offer.nbytes, protected)
            plan.evicted.extend(admission.evicted)
            if admission.inserted:
                record.was_inserted(offer.key)
                plan.write.append(offer.key)
                self._writing_since[offer.key] = now
            else:
                plan.refused.append(offer.key)
        return plan

    def writing(self, keys: Iterable[Key]) -> list[Key]:
        """The keys among `keys` whose payload is being written."""
        return [k for k in keys if self.policy.status(k) is ChunkStatus.WRITING]

    def writes_started(self, keys: Iterable[Key], now: float) -> list[Key]:
        """Restart the deadline of the keys among `keys` still being written; returns them."""
        started = [k for k in keys if k in self._writing_since]
        for key in started:
            self._writing_since[key] = now
            self._started.add(key)
        return started

    def stored(self, keys: Iterable[Key], ok: bool) -> list[Key]:
        """Complete writes; returns the keys that were being written (others are ignored, so a
        retried report is harmless)."""
        done = [k for k in keys if self.policy.complete_store(k, ok)]
        for key in done:
            self._writing_since.pop(key, None)
            self._started.discard(key)
        return done

    def expire_writes(
        self, now: float, max_age: float, max_unstarted_age: float | None = None
    ) -> list[Key]:
        """Fail the writes older than `max_age` since they started (`writes_started`), or than
        `max_unstarted_age` (default `max_age`) since `store` when their step never reported
        ending; returns their keys (their payloads, if any, are the caller's to delete)."""
        unstarted = max_age if max_unstarted_age is None else max_unstarted_age
        old = [
            k
            for k, t in self._writing_since.items()
            if now - t > (max_age if k in self._started else unstarted)
        ]
        return self.stored(old, ok=False)

    def load(
        self, holder: str, reads: Sequence[tuple[Key, int]], *, internal: bool = False
    ) -> list[Key]:
        """Pin the ready chunks among `reads` ((key, end position) pairs) for `holder`;
        returns the pinned keys, which the holder may now read."""
        pins = self._pins.setdefault(holder, Counter())
        record = None if internal else self._record(holder)
        pinned = []
        for key, end in reads:
            if self.policy.pin(key):
                pins[key] += 1
                pinned.append(key)
                if record is not None:
                    record.was_read(key, end)
        if not pins:
            del self._pins[holder]
        return pinned

    def loaded(self, holder: str, keys: Iterable[Key]) -> int:
        """Release `holder`'s pins on `keys`; returns how many were released."""
        pins = self._pins.get(holder)
        if pins is None:
            return 0
        released = 0
        for key in keys:
            if pins[key] > 0:
                pins[key] -= 1
                if pins[key] == 0:
                    del pins[key]
                self.policy.unpin(key)
                released += 1
        if not pins:
            del self._pins[holder]
        return released

    def request_finished(self, request_id: str) -> RequestRecord | None:
        pins = self._pins.pop(request_id, None)
        for key, count in (pins or {}).items():
            for _ in range(count):
                self.policy.unpin(key)
        record = self.records.pop(request_id, None)
        if record is not None:
            self.policy.on_request_finished(record)
        return record

    @property
    def pin_holders(self) -> int:
        return len(self._pins)

    def state(self) -> dict[str, object]:
        return {
            **self.policy.table.counts(),
            "capacity_bytes": self.policy.capacity_bytes,
            "evictions": self.policy.evictions,
            "requests": len(self.records),
            "pin_holders": self.pin_holders,
            "writes_started": len(self._started),  # being written, their step ended
            "policy": type(self.policy).__module__ + "." + type(self.policy).__name__,
        }
