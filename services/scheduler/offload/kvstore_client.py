"""The scheduler's client of the kvstore, over the bus (shared.rpc; shared/protocol/kvstore.py).

One client per model key space, sharing the scheduler's rpc client (one reply stream, one
reader). `verdicts` has the `ProbeBackend` shape, so `AsyncLookup(client.verdicts)` probes the
kvstore in one call per batch: a chunk being written answers HIT_PENDING, not a miss. Every
failure (no answer in time, no kvstore on the bus, Redis down, an error answer) raises
`KVStoreError`; `AsyncLookup` turns a failed probe into misses and the offload edge skips the
tier a while. An invalid call raises its subclass `KVStoreRefused`, which says nothing about the
kvstore's health.

Only `lookup`, `stats` and `ping` are sent twice on a slow answer: the other calls change the
kvstore's state, and a second `store` or `load` would reserve or pin again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from pydantic import ValidationError

from services.scheduler.offload.verdict import Verdict, verdict_of_status
from shared.kv.offload_key import OffloadKey
from shared.protocol import (
    KVChunkOffers,
    KVChunks,
    KVChunksAt,
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
    Ping,
    Pong,
    RpcReply,
    RpcRequest,
)
from shared.protocol.kvstore import CHUNK_STATES, STORE_OUTCOMES
from shared.rpc import RpcCallError, RpcClient, RpcError

R = TypeVar("R", bound=RpcReply)


class KVStoreError(Exception):
    """The call got no usable answer (the kvstore may be down: the tier is skipped a while)."""


class KVStoreRefused(KVStoreError):
    """The call itself is invalid (too many chunks, a bad name): refused before it was sent
    or by the kvstore. Says nothing about the kvstore's health."""


@dataclass(frozen=True, slots=True)
class StoreReply:
    write: list[OffloadKey]  # inserted WRITING: write these payloads, then report `stored`
    present: list[OffloadKey]
    refused: list[OffloadKey]
    evicted: int


class KVStoreClient:
    def __init__(
        self,
        rpc: RpcClient,
        stream: str,
        model: str,
        layout_version: int = 1,
        *,
        timeout_s: float = 2.0,
    ) -> None:
        self.rpc = rpc
        self.stream = stream
        self.model = model
        self.layout_version = layout_version
        self.timeout_s = timeout_s

    async def _call(self, request: RpcRequest, expect: type[R], *, safe: bool = False) -> R:
        try:
            return await self.rpc.call(
                self.stream, request, expect, self.timeout_s, attempts=2 if safe else 1
            )
        except RpcError as exc:
            error = KVStoreRefused if exc.kind == "bad_request" else KVStoreError
            raise error(f"kvstore {request.TYPE}: {exc}") from None
        except RpcCallError as exc:
            raise KVStoreError(f"kvstore {request.TYPE}: {type(exc).__name__}: {exc}") from None

    async def lookup(self, keys: Sequence[OffloadKey]) -> list[str]:
        """Each key's status: "ready", "pinned", "writing" or "missing"."""
        with _invalid_call():
            request = KVLookup(
                model=self.model, layout_version=self.layout_version, chunks=KVChunks.of(keys)
            )
        reply = await self._call(request, KVLookupReply, safe=True)
        if len(reply.statuses) != len(keys):
            raise KVStoreError(f"kvstore lookup: {len(reply.statuses)} statuses for {len(keys)}")
        return [CHUNK_STATES[code] for code in reply.statuses]

    async def verdicts(self, keys: list[OffloadKey]) -> dict[OffloadKey, Verdict]:
        """The verdict of each key present: HIT (readable now) or HIT_PENDING (its write is in
        flight); a missing key is left out (a `ProbeBackend`)."""
        statuses = await self.lookup(keys)
        found = {k: verdict_of_status(s) for k, s in zip(keys, statuses, strict=True)}
        return {k: v for k, v in found.items() if v is not Verdict.MISS}

    async def store(
        self, request_id: str, offers: Sequence[tuple[OffloadKey, int, int]]
    ) -> StoreReply:
        """Offer (key, end position, nbytes) chunks for store."""
        with _invalid_call():
            request = KVStore(
                model=self.model,
                layout_version=self.layout_version,
                request_id=request_id,
                chunks=KVChunkOffers.offers(offers),
            )
        reply = await self._call(request, KVStoreReply)
        if len(reply.outcomes) != len(offers):
            raise KVStoreError(f"kvstore store: {len(reply.outcomes)} outcomes for {len(offers)}")
        # Ordered sets: a key offered twice is answered once.
        by_outcome: dict[str, dict[OffloadKey, None]] = {name: {} for name in STORE_OUTCOMES}
        for (key, _, _), code in zip(offers, reply.outcomes, strict=True):
            by_outcome[STORE_OUTCOMES[code]][key] = None
        write, present, refused = (list(by_outcome[name]) for name in STORE_OUTCOMES)
        return StoreReply(write, present, refused, reply.evicted)

    async def writing(self, keys: Sequence[OffloadKey]) -> int:
        """The step computing these chunks ended: their write deadline restarts now."""
        with _invalid_call():
            request = KVWriting(
                model=self.model, layout_version=self.layout_version, chunks=KVChunks.of(keys)
            )
        return (await self._call(request, KVCountReply)).count

    async def stored(self, offers: Sequence[tuple[OffloadKey, int, int]], ok: bool) -> int:
        with _invalid_call():
            request = KVStored(
                model=self.model,
                layout_version=self.layout_version,
                chunks=KVChunkOffers.offers(offers),
                ok=ok,
            )
        return (await self._call(request, KVCountReply)).count

    async def load(
        self, holder: str, reads: Sequence[tuple[OffloadKey, int]], *, internal: bool = False
    ) -> list[OffloadKey]:
        """Pin the ready chunks among `reads` for `holder`; returns the pinned keys."""
        with _invalid_call():
            request = KVLoad(
                model=self.model,
                layout_version=self.layout_version,
                holder=holder,
                internal=internal,
                chunks=KVChunksAt.at(reads),
            )
        reply = await self._call(request, KVLoadReply)
        if len(reply.pinned) != len(reads):
            raise KVStoreError(f"kvstore load: {len(reply.pinned)} answers for {len(reads)}")
        pinned = [key for (key, _), flag in zip(reads, reply.pinned, strict=True) if flag]
        return list(dict.fromkeys(pinned))  # a key read twice is pinned once

    async def loaded(self, holder: str, keys: Sequence[OffloadKey]) -> int:
        with _invalid_call():
            request = KVLoaded(
                model=self.model,
                layout_version=self.layout_version,
                holder=holder,
                chunks=KVChunks.of(keys),
            )
        return (await self._call(request, KVCountReply)).count

    async def request_finished(self, request_id: str) -> KVFinishedReply:
        with _invalid_call():
            request = KVRequestFinished(request_id=request_id)
        return await self._call(request, KVFinishedReply)

    async def stats(self) -> KVStatsReply:
        return await self._call(KVStats(), KVStatsReply, safe=True)

    async def ping(self) -> Pong:
        """Whether a kvstore is serving now (answered by its rpc server itself)."""
        return await self._call(Ping(), Pong, safe=True)


@contextmanager
def _invalid_call() -> Iterator[None]:
    """A request its protocol model refuses (too many chunks, an empty id) is a KVStoreRefused
    like any other failed call, never an exception the offload edge does not expect."""
    try:
        yield
    except ValidationError as exc:
        raise KVStoreRefused(f"kvstore call not sent: {exc.errors()[0]['msg']}") from None
