"""Under a small capacity, eviction keeps the heads of hot prefixes: the kvstore service on a
real Redis, driven the way the scheduler and workers drive it (store, write, stored, load,
loaded, request_finished). Evicted chunks lose payload and metadata together, tails go before
heads, and a prefix that requests keep reusing keeps its head while cold prefixes go."""

from __future__ import annotations

import redis.asyncio as aioredis

from services.scheduler.offload.kvstore_client import KVStoreClient
from shared.kv.offload_key import OffloadKey
from tests.integration.kvstore.running import NBYTES, SPACE, kvstore
from tests.unit.kvstore.prefix import prefix_chunks

CAPACITY = 8  # chunks


async def store(
    client: KVStoreClient, r: aioredis.Redis, rid: str, chunks: list[tuple[OffloadKey, int]]
) -> list[OffloadKey]:
    """Offer, write what the kvstore asks for, report; returns the keys written."""
    reply = await client.store(rid, [(k, end, NBYTES) for k, end in chunks])
    ends = dict(chunks)
    for key in reply.write:
        await r.set(SPACE.payload_key(key), b"\x01" * NBYTES)
    await client.stored([(k, ends[k], NBYTES) for k in reply.write], ok=True)
    return reply.write


async def reuse(client: KVStoreClient, rid: str, chunks: list[tuple[OffloadKey, int]]) -> None:
    """A request that loads a cached head and finishes (its one access)."""
    pinned = await client.load(rid, chunks)
    assert pinned == [k for k, _ in chunks]
    await client.loaded(rid, pinned)
    await client.request_finished(rid)


async def present(r: aioredis.Redis, keys: list[OffloadKey]) -> list[bool]:
    """Per key: payload and metadata both present (asserts they never disagree)."""
    out = []
    for key in keys:
        payload = bool(await r.exists(SPACE.payload_key(key)))
        meta = bool(await r.exists(SPACE.meta_key(key)))
        assert payload == meta, f"{key}: payload {payload}, metadata {meta}"
        out.append(payload)
    return out


async def test_eviction_keeps_the_heads_of_hot_prefixes(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    hot = prefix_chunks(4, seed=1)  # a system prompt every request starts with
    hot_keys = [k for k, _ in hot]
    async with kvstore(redis_url, capacity_chunks=CAPACITY) as kv:
        client = kv.client()
        assert await store(client, r, "first", hot) == hot_keys
        await client.request_finished("first")
        for n in range(6):  # cold prefixes stream in; requests keep reusing the hot head
            await reuse(client, f"hot-{n}", hot[:2])
            cold = prefix_chunks(3, seed=10 + n)
            written = await store(client, r, f"cold-{n}", cold)
            assert written == [k for k, _ in cold]  # room is always made (nothing pinned)
            await client.request_finished(f"cold-{n}")
            state = await kv.state()
            assert state["chunks"] <= CAPACITY
            # The hot head survives every round; a tail never outlives its head.
            hot_present = await present(r, hot_keys)
            assert hot_present[:2] == [True, True], (n, hot_present)
            assert hot_present == sorted(hot_present, reverse=True), hot_present
            cold_present = await present(r, [k for k, _ in cold])
            assert cold_present == sorted(cold_present, reverse=True), cold_present
        # The hot prefix's unused tail and the oldest cold prefixes were evicted.
        assert await present(r, hot_keys[2:]) == [False, False]
        assert await present(r, [k for k, _ in prefix_chunks(3, seed=10)]) == [False] * 3
        assert state["evictions"] > 0
        assert state["used_bytes"] == state["chunks"] * NBYTES
    await r.aclose()


async def test_the_writing_call_restarts_only_writes_in_progress(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    chunks = prefix_chunks(3, seed=2)
    keys = [k for k, _ in chunks]
    async with kvstore(redis_url, capacity_chunks=CAPACITY) as kv:
        client = kv.client()
        reply = await client.store("r1", [(k, end, NBYTES) for k, end in chunks])
        assert reply.write == keys
        await r.set(SPACE.payload_key(keys[0]), b"\x01" * NBYTES)
        assert await client.stored([(keys[0], chunks[0][1], NBYTES)], ok=True) == 1
        assert await client.writing(keys) == 2  # the ready one is not being written
        assert await client.lookup(keys) == ["ready", "writing", "writing"]
    await r.aclose()
