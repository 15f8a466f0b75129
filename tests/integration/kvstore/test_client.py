"""KVStoreClient and AsyncLookup against a real kvstore service and Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.kvstore_client import KVStoreClient, KVStoreError, verdict_of_status
from services.scheduler.offload.window_scan import Verdict
from tests.integration.kvstore.running import MODEL, NBYTES, SPACE, kvstore
from tests.support.redis_server import free_port
from tests.unit.kvstore.prefix import prefix_chunks


async def test_store_load_and_finish_through_the_client(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    chunks = prefix_chunks(3)
    keys = [k for k, _ in chunks]
    offers = [(k, end, NBYTES) for k, end in chunks]
    async with kvstore(redis_url, capacity_chunks=8) as http:
        client = KVStoreClient("", MODEL, http=http)
        reply = await client.store("r1", offers)
        assert reply.write == keys and reply.evicted == 0
        for key in keys[:2]:
            await r.set(SPACE.payload_key(key), b"\0" * NBYTES)
        assert await client.stored(offers[:2], ok=True) == 2
        statuses = await client.lookup(keys)
        assert statuses == ["ready", "ready", "writing"]
        assert [verdict_of_status(s) for s in statuses] == [
            Verdict.HIT,
            Verdict.HIT,
            Verdict.HIT_PENDING,
        ]
        assert await client.load("r2", chunks[:3]) == keys[:2]
        assert await client.lookup(keys[:1]) == ["pinned"]
        assert await client.loaded("r2", keys[:2]) == 2
        summary = await client.request_finished("r2")
        assert summary["reused"] == 2
        assert (await client.store("r3", offers[:1])).present == keys[:1]
    await r.aclose()


async def test_async_lookup_probes_the_kvstore_once_per_batch(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    chunks = prefix_chunks(3)
    keys = [k for k, _ in chunks]
    async with kvstore(redis_url, capacity_chunks=8) as http:
        client = KVStoreClient("", MODEL, http=http)
        await client.store("w", [(k, e, NBYTES) for k, e in chunks[:2]])
        await r.set(SPACE.payload_key(keys[0]), b"\0" * NBYTES)
        await client.stored([(keys[0], chunks[0][1], NBYTES)], ok=True)
        probes: list[int] = []

        async def backend(batch: list) -> set:
            probes.append(len(batch))
            return set(await client.existing(batch))

        lookup = AsyncLookup(backend)
        assert [lookup.lookup("A", k) for k in keys] == [None, None, None]
        await asyncio.gather(*lookup.flush())
        # ready -> True; still being written or absent -> not readable now.
        assert [lookup.lookup("A", k) for k in keys] == [True, False, False]
        assert probes == [3]
    await r.aclose()


async def test_an_unreachable_kvstore_counts_as_misses() -> None:
    ((key, _),) = prefix_chunks(1)
    client = KVStoreClient(f"http://127.0.0.1:{free_port()}", MODEL, timeout_s=1)
    with pytest.raises(KVStoreError, match="lookup"):
        await client.lookup([key])
    lookup = AsyncLookup(client.existing)
    lookup.lookup("A", key)
    await asyncio.gather(*lookup.flush())
    assert lookup.lookup("A", key) is False
    await client.aclose()


async def test_a_refused_body_is_a_clear_error(redis_url: str) -> None:
    async with kvstore(redis_url, capacity_chunks=1) as http:
        client = KVStoreClient("", "", http=http)  # an empty model name is refused
        with pytest.raises(KVStoreError, match="HTTP 422"):
            await client.lookup([])
