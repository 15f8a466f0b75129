"""The kvstore service against a real Redis, called over the bus: eviction deletes payload and
metadata together, metadata rebuilds the tier after a restart, failed writes leave nothing
behind, and garbage on its calls stream is dead-lettered while it keeps serving."""

from __future__ import annotations

import time

import msgpack
import redis.asyncio as aioredis

from services.scheduler.offload.kvstore_client import KVStoreClient
from shared.bus import Bus
from shared.kv.offload_key import OffloadKey
from shared.protocol import AbortRequest, KVChunks, KVLookup, KVStats
from tests.integration.kvstore.running import MODEL, NBYTES, SPACE, STREAMS, kvstore
from tests.unit.kvstore.prefix import prefix_chunks


def offers(chunks: list[tuple[OffloadKey, int]]) -> list[tuple[OffloadKey, int, int]]:
    return [(k, end, NBYTES) for k, end in chunks]


async def store_prefix(
    client: KVStoreClient, r: aioredis.Redis, request_id: str, chunks: list[tuple[OffloadKey, int]]
) -> None:
    """What the scheduler + worker do: offer, write the payloads, report, finish."""
    plan = await client.store(request_id, offers(chunks))
    assert plan.write == [k for k, _ in chunks]
    for key, _ in chunks:
        await r.set(SPACE.payload_key(key), b"\x01" * NBYTES)  # the worker's write
    assert await client.stored(offers(chunks), ok=True) == len(chunks)
    await client.request_finished(request_id)


async def exists(r: aioredis.Redis, key: OffloadKey) -> tuple[bool, bool]:
    return (
        bool(await r.exists(SPACE.payload_key(key))),
        bool(await r.exists(SPACE.meta_key(key))),
    )


async def test_eviction_deletes_payload_and_metadata_together(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    old = prefix_chunks(2, seed=1)
    new = prefix_chunks(1, seed=2)
    async with kvstore(redis_url, capacity_chunks=2) as kv:
        client = kv.client()
        await store_prefix(client, r, "r1", old)
        meta = await r.hgetall(SPACE.meta_key(old[0][0]))
        assert meta[b"nbytes"] == b"100" and meta[b"end"] == b"16"
        plan = await client.store("r2", offers(new))
        assert plan.write == [new[0][0]] and plan.evicted == 1
        # r1's tail went first (its head is the most recent): payload and metadata both gone.
        assert await exists(r, old[1][0]) == (False, False)
        assert await exists(r, old[0][0]) == (True, True)
        statuses = await client.lookup([k for k, _ in [*old, *new]])
        assert statuses == ["ready", "missing", "writing"]
        state = await kv.state()
        assert state["chunks"] == 2 and state["evictions"] == 1 and state["undeleted"] == 0
        assert state["used_bytes"] == 2 * NBYTES
        stats = await client.stats()  # the same numbers, asked over the bus
        assert (stats.chunks, stats.evictions, stats.used_bytes) == (2, 1, 2 * NBYTES)
        assert (stats.writing, stats.ready, stats.capacity_bytes) == (1, 1, 2 * NBYTES)
    await r.aclose()


async def test_pinned_chunks_are_not_evicted_and_refusal_deletes_nothing(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    old = prefix_chunks(1, seed=1)
    new = prefix_chunks(1, seed=2)
    async with kvstore(redis_url, capacity_chunks=1) as kv:
        client = kv.client()
        await store_prefix(client, r, "r1", old)
        assert await client.load("r2", [(old[0][0], 16)]) == [old[0][0]]
        plan = await client.store("r3", offers(new))
        assert plan.refused == [new[0][0]] and plan.evicted == 0
        assert await exists(r, old[0][0]) == (True, True)
        assert await client.loaded("r2", [old[0][0]]) == 1
        plan = await client.store("r3", offers(new))
        assert plan.evicted == 1 and await exists(r, old[0][0]) == (False, False)
    await r.aclose()


async def test_failed_write_leaves_no_payload_and_no_metadata(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    ((key, end),) = prefix_chunks(1)
    async with kvstore(redis_url, capacity_chunks=4) as kv:
        client = kv.client()
        await client.store("r1", [(key, end, NBYTES)])
        await r.set(SPACE.payload_key(key), b"partial")
        assert await client.stored([(key, end, NBYTES)], ok=False) == 1
        assert await exists(r, key) == (False, False)
        assert await client.lookup([key]) == ["missing"]
    await r.aclose()


async def test_restart_rebuilds_the_tier_from_metadata(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    first = prefix_chunks(2, seed=1)
    second = prefix_chunks(1, seed=2)
    async with kvstore(redis_url, capacity_chunks=4) as kv:
        client = kv.client()
        await store_prefix(client, r, "r1", first)
        await store_prefix(client, r, "r2", second)
        # A chunk still being written at shutdown has no metadata: it is not recovered.
        await client.store("r3", offers(prefix_chunks(1, seed=3)))
    await r.delete(SPACE.payload_key(first[1][0]))  # a payload lost behind the kvstore's back
    async with kvstore(redis_url, capacity_chunks=4) as kv:
        client = kv.client()
        state = await kv.state()
        assert state["recovered"] == 2 and state["ready"] == 2 and state["writing"] == 0
        statuses = await client.lookup([k for k, _ in [*first, *second]])
        assert statuses == ["ready", "missing", "ready"]
        assert await exists(r, first[1][0]) == (False, False)  # its dangling metadata removed
        # Recovered chunks keep their store order: the older one is evicted first.
        plan = await client.store("r4", offers(prefix_chunks(3, seed=4)))
        assert plan.evicted == 1
        assert await exists(r, first[0][0]) == (False, False)
        assert await exists(r, second[0][0]) == (True, True)
    await r.aclose()


async def test_garbage_calls_are_dead_lettered_and_the_kvstore_keeps_serving(
    redis_url: str,
) -> None:
    """Undecodable entries, columns that disagree, a call that is no call and a reply stream
    outside the rpc namespace: each goes to the dead letters; the next real call is served."""
    r = aioredis.Redis.from_url(redis_url)
    calls = STREAMS.calls("kvstore")
    ((key, _),) = prefix_chunks(1)
    async with kvstore(redis_url, capacity_chunks=4) as kv:
        forger = Bus(redis_url, "forger")
        await forger.connect()
        await r.xadd(calls, {"m": b"\xc1 not msgpack"})
        await r.xadd(calls, {"wrong": b"field"})
        lookup = KVLookup(model=MODEL, chunks=KVChunks.of([key]))
        envelope = lookup.model_dump(mode="python", exclude_defaults=True)
        envelope["chunks"]["groups"] = b"\x00" * 8  # two groups for one hash
        await r.xadd(calls, {"m": msgpack.packb({"t": "kv_lookup", "v": 1, "b": envelope})})
        await forger.publish(calls, AbortRequest(request_id="not a call"))
        stray = KVStats(
            correlation_id="c", reply_stream="meshllm:kvt:requests", deadline=time.time() + 9
        )
        await forger.publish(calls, stray)
        await forger.close()
        assert await kv.client().lookup([key]) == ["missing"]  # still serving, in order
        assert kv.service.rpc is not None and kv.service.rpc.served == 1
    dead = await r.xrange(STREAMS.deadletter)
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert reasons == ["malformed", "missing_field", "invalid", "bad_envelope", "bad_envelope"]
    assert b"groups has 2 items for 1 chunks" in dead[2][1][b"detail"]
    assert not await r.exists("meshllm:kvt:requests")
    await r.aclose()
