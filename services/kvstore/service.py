"""The kvstore service: the offload tier's policy state, behind `/v1/kv/*` (see http_api).

It owns which chunks exist, their recency and their pins (`OffloadTier` around the configured
policy); workers own the payload bytes in Redis. Its own Redis work is small: metadata hashes
for ready chunks, deleting payload + metadata together on eviction, and rebuilding the table
from the metadata on start (so the tier survives a kvstore restart; recovered chunks are ready
and ordered by their store sequence).

A call changes the in-memory state first and then does its Redis work. Evicted keys are removed
from the table before their Redis delete is awaited, so nothing can pin them meanwhile; a delete
that fails (Redis unreachable) is kept and retried by `run()` until it succeeds; `run()` also
fails writes that were never reported (deleting their payloads): within `write_timeout_s` of
`writing` (the scheduler's word that the step computing the chunks ended: the deadline covers
the writes, not the prefill before them), or `write_start_timeout_s` of `store` without it.

No payload without its metadata: a write reported done after the kvstore gave up on it (expired,
or failed by a concurrent report, or unknown to a restarted kvstore) finds its key absent from
the table, and its payload is deleted instead of being left unaccounted for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Hashable, Iterable
from typing import Any

from fastapi import APIRouter

from services.kvstore.http_api import (
    ChunkRef,
    FinishedBody,
    LoadBody,
    LoadedBody,
    LookupBody,
    StoreBody,
    StoredBody,
    WritingBody,
    kv_router,
)
from services.kvstore.offload_tier import ChunkOffer, OffloadTier
from services.kvstore.policy import load_policy
from services.kvstore.redis_index import RedisOffloadIndex, StoredChunk, store_seq
from shared.bus_retry import retry
from shared.config import KVStoreSettings
from shared.service import Service

log = logging.getLogger(__name__)

RETRY_DELETES_S = 1.0  # also how often expired writes are looked for
MISSING = "missing"


class KVStoreService(Service):
    name = "kvstore"

    def __init__(self, settings: KVStoreSettings) -> None:
        super().__init__(settings)
        self.settings: KVStoreSettings = settings
        self.tier: OffloadTier | None = None  # set once start() has rebuilt it: routes 503 before
        self.index: RedisOffloadIndex
        self.undeleted: set[str] = set()  # evicted payload keys whose Redis delete failed
        self.recovered = 0

    async def start(self) -> None:
        await super().start()
        policy = load_policy(self.settings.policy, self.settings.capacity_bytes)
        self.index = RedisOffloadIndex(self.bus.redis, self.settings.cluster)
        dropped = []
        # However long Redis takes: a kvstore that exits for an outage helps nobody.
        for chunk in await retry("kvstore recovery", self.index.scan_meta, None):
            if policy.restore(chunk.payload_key, chunk.nbytes):
                self.recovered += 1
            else:
                dropped.append(chunk.payload_key)  # over the (possibly smaller) capacity now
        await retry("kvstore recovery", lambda: self.index.delete(dropped), None)
        self.tier = OffloadTier(policy)
        log.info("kvstore ready: %d chunks recovered, %d dropped", self.recovered, len(dropped))

    async def run(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), RETRY_DELETES_S)
            if self.undeleted:
                await self._delete(list(self.undeleted))
            expired = _names(
                self._tier().expire_writes(
                    time.monotonic(),
                    self.settings.write_timeout_s,
                    self.settings.write_start_timeout_s,
                )
            )
            if expired:
                log.warning("%d chunk writes never completed; dropped", len(expired))
                with contextlib.suppress(Exception):  # a leftover partial payload is harmless
                    await self.index.delete_payloads(expired)

    def routes(self) -> list[APIRouter]:
        return [kv_router(lambda: self if self.tier is not None else None)]

    # --- the API (called by http_api once started) ---------------------------------------------

    def _tier(self) -> OffloadTier:
        assert self.tier is not None, "routes answer 503 until start() has set the tier"
        return self.tier

    def lookup(self, body: LookupBody) -> dict[str, Any]:
        space = body.space(self.settings.cluster)
        names = [space.payload_key(c.key()) for c in body.chunks]
        statuses = self._tier().lookup(names)
        return {"statuses": [MISSING if s is None else s.value for s in statuses]}

    async def store(self, body: StoreBody) -> dict[str, Any]:
        space = body.space(self.settings.cluster)
        refs = {space.payload_key(c.key()): c for c in body.chunks}
        offers = [ChunkOffer(name, c.end, c.nbytes) for name, c in refs.items()]
        plan = self._tier().store(body.request_id, offers, now=time.monotonic())
        await self._delete(_names(plan.evicted))
        return {
            "write": [_ref(refs[k]) for k in _names(plan.write)],
            "present": [_ref(refs[k]) for k in _names(plan.present)],
            "refused": [_ref(refs[k]) for k in _names(plan.refused)],
            "evicted": len(plan.evicted),
        }

    def writing(self, body: WritingBody) -> dict[str, Any]:
        space = body.space(self.settings.cluster)
        names = [space.payload_key(c.key()) for c in body.chunks]
        return {"restarted": len(self._tier().writes_started(names, time.monotonic()))}

    async def stored(self, body: StoredBody) -> dict[str, Any]:
        space = body.space(self.settings.cluster)
        tier = self._tier()
        chunks = {space.payload_key(c.key()): c for c in body.chunks}
        writing = _names(tier.writing(chunks))
        if body.ok and writing:
            # Metadata first, while the chunks are still WRITING and so cannot be evicted: an
            # eviction can then never run before the metadata it must delete exists.
            seq = store_seq()
            await self.index.write_meta(
                [StoredChunk(k, chunks[k].nbytes, chunks[k].end, seq) for k in writing]
            )
        completed = _names(tier.stored(writing, body.ok))
        # Absent keys were given up on (expired) or never offered here: their payload, if the
        # worker wrote it anyway, has no metadata and nobody accounts for it, so it goes.
        absent = [k for k, s in zip(chunks, tier.lookup(chunks), strict=True) if s is None]
        if not body.ok:
            await self.index.delete_payloads(completed)
        await self.index.delete_payloads([k for k in absent if k not in completed])
        return {"completed": len(completed)}

    def load(self, body: LoadBody) -> dict[str, Any]:
        space = body.space(self.settings.cluster)
        refs = {space.payload_key(c.key()): c for c in body.chunks}
        reads = [(name, c.end) for name, c in refs.items()]
        pinned = self._tier().load(body.holder, reads, internal=body.internal)
        return {"pinned": [_ref(refs[k]) for k in _names(pinned)]}

    def loaded(self, body: LoadedBody) -> dict[str, Any]:
        space = body.space(self.settings.cluster)
        names = [space.payload_key(c.key()) for c in body.chunks]
        return {"released": self._tier().loaded(body.holder, names)}

    def request_finished(self, body: FinishedBody) -> dict[str, Any]:
        record = self._tier().request_finished(body.request_id)
        return {"request_id": body.request_id, **(record.summary() if record else {"keys": 0})}

    async def _delete(self, payload_keys: list[str]) -> None:
        if not payload_keys:
            return
        try:
            await self.index.delete(payload_keys)
        except Exception as exc:
            log.warning(
                "deleting %d evicted chunks failed (%s); will retry", len(payload_keys), exc
            )
            self.undeleted.update(payload_keys)
        else:
            self.undeleted.difference_update(payload_keys)

    def state(self) -> dict[str, Any]:
        out = {**super().state(), "role": "kvstore"}
        if self.tier is not None:
            out["kvstore"] = {
                **self.tier.state(),
                "recovered": self.recovered,
                "undeleted": len(self.undeleted),
            }
        return out


def _names(keys: Iterable[Hashable]) -> list[str]:
    """The tier's keys here are payload key names (see OffloadTier: keys are opaque to it)."""
    return [str(k) for k in keys]


def _ref(chunk: ChunkRef) -> dict[str, Any]:
    return {"group": chunk.group, "hash": chunk.hash.lower()}
