"""The kvstore's calls (shared.rpc on `Streams.calls("kvstore")`; shared/protocol/kvstore.py).

Each handler changes the in-memory tier first, then does its Redis work. Chunks arrive as
(block hash, group) columns and are named here by their payload key in the call's key space
(the tier's keys are those names, so one model never sees another's chunks). Answers are per
chunk, in the order asked; a chunk named twice in one call is one chunk.

Evicted keys leave the table before their Redis delete is awaited, so nothing can pin them
meanwhile; a delete that fails is kept in `undeleted` and retried by the service's loop.
No payload without its metadata: a write reported done after the kvstore gave up on it
(expired, failed by a concurrent report, or unknown to a restarted kvstore) finds its key
absent from the table, and its payload is deleted instead of being left unaccounted for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable

from services.kvstore.chunk_table import ChunkStatus
from services.kvstore.offload_tier import ChunkOffer, OffloadTier
from services.kvstore.redis_index import RedisOffloadIndex, StoredChunk, store_seq
from shared.protocol import (
    KVCountReply,
    KVFinishedReply,
    KVLoad,
    KVLoaded,
    KVLoadReply,
    KVLookup,
    KVLookupReply,
    KVRequestFinished,
    KVStats,
    KVStatsReply,
    KVStore,
    KVStored,
    KVStoreReply,
    KVWriting,
    RpcRequest,
)
from shared.protocol.kvstore import CHUNK_STATES, STORE_OUTCOMES, KVChunks, KVScoped
from shared.rpc import Handler

log = logging.getLogger(__name__)

_STATE_CODE = {None: CHUNK_STATES.index("missing")} | {
    status: CHUNK_STATES.index(status.value) for status in ChunkStatus
}
_WRITE, _PRESENT, _REFUSED = (STORE_OUTCOMES.index(o) for o in ("write", "present", "refused"))


class OffloadCalls:
    def __init__(
        self, tier: OffloadTier, index: RedisOffloadIndex, cluster: str, recovered: int = 0
    ) -> None:
        self.tier = tier
        self.index = index
        self.cluster = cluster
        self.recovered = recovered  # chunks rebuilt from metadata at start
        self.undeleted: set[str] = set()  # evicted payload keys whose Redis delete failed

    def handlers(self) -> dict[type[RpcRequest], Handler]:
        return {
            KVLookup: self.lookup,
            KVStore: self.store,
            KVWriting: self.writing,
            KVStored: self.stored,
            KVLoad: self.load,
            KVLoaded: self.loaded,
            KVRequestFinished: self.request_finished,
            KVStats: self.stats,
        }

    def _names(self, req: KVScoped, chunks: KVChunks) -> list[str]:
        space = req.space(self.cluster)
        return [space.payload_key(key) for key in chunks.offload_keys()]

    async def lookup(self, req: KVLookup) -> KVLookupReply:
        statuses = self.tier.lookup(self._names(req, req.chunks))
        return KVLookupReply(statuses=[_STATE_CODE[s] for s in statuses])

    async def store(self, req: KVStore) -> KVStoreReply:
        names = self._names(req, req.chunks)
        c = req.chunks
        columns = zip(names, c.ends, c.nbytes, strict=True)
        offers = {n: ChunkOffer(n, end, nb) for n, end, nb in columns}
        plan = self.tier.store(req.request_id, list(offers.values()), now=time.monotonic())
        await self.delete(_strs(plan.evicted))
        code = dict.fromkeys(_strs(plan.write), _WRITE)
        code |= dict.fromkeys(_strs(plan.present), _PRESENT)
        code |= dict.fromkeys(_strs(plan.refused), _REFUSED)
        return KVStoreReply(outcomes=[code[n] for n in names], evicted=len(plan.evicted))

    async def writing(self, req: KVWriting) -> KVCountReply:
        names = self._names(req, req.chunks)
        return KVCountReply(count=len(self.tier.writes_started(names, time.monotonic())))

    async def stored(self, req: KVStored) -> KVCountReply:
        c = req.chunks
        columns = zip(self._names(req, c), c.ends, c.nbytes, strict=True)
        sizes = {n: (end, nb) for n, end, nb in columns}
        writing = _strs(self.tier.writing(sizes))
        if req.ok and writing:
            # Metadata first, while the chunks are still WRITING and so cannot be evicted: an
            # eviction can then never run before the metadata it must delete exists.
            seq = store_seq()
            await self.index.write_meta(
                [StoredChunk(k, sizes[k][1], sizes[k][0], seq) for k in writing]
            )
        completed = _strs(self.tier.stored(writing, req.ok))
        # Absent keys were given up on (expired) or never offered here: their payload, if the
        # worker wrote it anyway, has no metadata and nobody accounts for it, so it goes.
        absent = [k for k, s in zip(sizes, self.tier.lookup(sizes), strict=True) if s is None]
        if not req.ok:
            await self.index.delete_payloads(completed)
        await self.index.delete_payloads([k for k in absent if k not in completed])
        return KVCountReply(count=len(completed))

    async def load(self, req: KVLoad) -> KVLoadReply:
        names = self._names(req, req.chunks)
        reads = dict(zip(names, req.chunks.ends, strict=True))
        pinned = set(self.tier.load(req.holder, list(reads.items()), internal=req.internal))
        return KVLoadReply(pinned=[int(n in pinned) for n in names])

    async def loaded(self, req: KVLoaded) -> KVCountReply:
        names = self._names(req, req.chunks)
        return KVCountReply(count=self.tier.loaded(req.holder, names))

    async def request_finished(self, req: KVRequestFinished) -> KVFinishedReply:
        record = self.tier.request_finished(req.request_id)
        return KVFinishedReply(**record.summary()) if record else KVFinishedReply()

    async def stats(self, req: KVStats) -> KVStatsReply:
        t = self.tier
        return KVStatsReply(
            **t.policy.table.counts(),
            capacity_bytes=t.policy.capacity_bytes,
            evictions=t.policy.evictions,
            requests=len(t.records),
            pin_holders=t.pin_holders,
            recovered=self.recovered,
            undeleted=len(self.undeleted),
        )

    async def delete(self, payload_keys: list[str]) -> None:
        """Delete evicted chunks (payload + metadata); a failure is kept for a retry."""
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


def _strs(keys: Iterable[Hashable]) -> list[str]:
    """The tier's keys here are payload key names (see OffloadTier: keys are opaque to it)."""
    return [str(k) for k in keys]
