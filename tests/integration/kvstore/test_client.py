"""KVStoreClient and AsyncLookup against a real kvstore service over the bus, and without one."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.kvstore_client import (
    KVStoreClient,
    KVStoreError,
    KVStoreRefused,
)
from services.scheduler.offload.verdict import Verdict
from shared.bus import Bus
from shared.protocol.kvstore import MAX_CHUNKS
from shared.streams import RPC_GROUP
from tests.integration.kvstore.running import (
    MODEL,
    NBYTES,
    SPACE,
    STREAMS,
    kvstore,
    scheduler_rpc,
)
from tests.unit.kvstore.prefix import prefix_chunks, prefix_keys


async def test_store_load_and_finish_through_the_client(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    chunks = prefix_chunks(3)
    keys = [k for k, _ in chunks]
    offers = [(k, end, NBYTES) for k, end in chunks]
    async with kvstore(redis_url, capacity_chunks=8) as kv:
        client = kv.client()
        reply = await client.store("r1", offers)
        assert reply.write == keys and reply.evicted == 0
        for key in keys[:2]:
            await r.set(SPACE.payload_key(key), b"\0" * NBYTES)
        assert await client.stored(offers[:2], ok=True) == 2
        statuses = await client.lookup(keys)
        assert statuses == ["ready", "ready", "writing"]
        assert await client.verdicts(keys) == {
            keys[0]: Verdict.HIT,
            keys[1]: Verdict.HIT,
            keys[2]: Verdict.HIT_PENDING,
        }
        assert await client.load("r2", chunks[:3]) == keys[:2]
        assert await client.lookup(keys[:1]) == ["pinned"]
        assert await client.loaded("r2", keys[:2]) == 2
        summary = await client.request_finished("r2")
        assert (summary.keys, summary.reused) == (2, 2)
        assert (await client.store("r3", offers[:1])).present == keys[:1]
        # A chunk named twice in one call is one chunk, in every answer.
        assert await client.load("r4", [chunks[0], chunks[0]]) == keys[:1]
        assert await client.loaded("r4", keys[:1]) == 1
        assert (await client.ping()).service == "kvstore"
    await r.aclose()


async def test_async_lookup_probes_the_kvstore_once_per_batch(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    chunks = prefix_chunks(3)
    keys = [k for k, _ in chunks]
    async with kvstore(redis_url, capacity_chunks=8) as kv:
        client = kv.client()
        await client.store("w", [(k, e, NBYTES) for k, e in chunks[:2]])
        await r.set(SPACE.payload_key(keys[0]), b"\0" * NBYTES)
        await client.stored([(keys[0], chunks[0][1], NBYTES)], ok=True)
        probes: list[int] = []

        async def backend(batch: list) -> dict:
            probes.append(len(batch))
            return await client.verdicts(batch)

        lookup = AsyncLookup(backend)
        assert [lookup.lookup("A", k) for k in keys] == [Verdict.RETRY] * 3
        await asyncio.gather(*lookup.flush())
        # ready -> HIT; still being written -> HIT_PENDING (asked again); absent -> MISS.
        assert [lookup.lookup("A", k) for k in keys] == [
            Verdict.HIT,
            Verdict.HIT_PENDING,
            Verdict.MISS,
        ]
        assert probes == [3]
        # The pending chunk is probed again at the next flush: its write landed, a HIT now.
        await r.set(SPACE.payload_key(keys[1]), b"\0" * NBYTES)
        await client.stored([(keys[1], chunks[1][1], NBYTES)], ok=True)
        await asyncio.gather(*lookup.flush())
        assert lookup.lookup("A", keys[1]) is Verdict.HIT
        assert probes == [3, 1]
    await r.aclose()


async def test_no_kvstore_on_the_bus_fails_at_once_and_counts_as_misses(redis_url: str) -> None:
    ((key, _),) = prefix_chunks(1)
    async with scheduler_rpc(redis_url) as rpc:
        client = KVStoreClient(rpc, STREAMS.calls("kvstore"), MODEL, timeout_s=30)
        started = time.monotonic()
        with pytest.raises(KVStoreError, match="kv_lookup: RpcUnavailable"):
            await client.lookup([key])
        assert time.monotonic() - started < 5  # never started: no timeout to wait out
        lookup = AsyncLookup(client.verdicts)
        lookup.lookup("A", key)
        await asyncio.gather(*lookup.flush())
        assert lookup.lookup("A", key) is Verdict.MISS


async def test_a_stopped_kvstore_is_a_timeout(redis_url: str) -> None:
    ((key, _),) = prefix_chunks(1)
    bus = Bus(redis_url, "kv-gone")
    await bus.connect()
    await bus.ensure_group(STREAMS.calls("kvstore"), RPC_GROUP)  # it ran once, and died
    await bus.close()
    async with scheduler_rpc(redis_url) as rpc:
        client = KVStoreClient(rpc, STREAMS.calls("kvstore"), MODEL, timeout_s=0.3)
        with pytest.raises(KVStoreError, match="kv_store: RpcTimeout"):
            await client.store("r", [(key, 16, NBYTES)])


async def test_an_invalid_call_is_refused_without_blaming_the_kvstore(redis_url: str) -> None:
    async with kvstore(redis_url, capacity_chunks=1) as kv:
        with pytest.raises(KVStoreRefused, match="kvstore call not sent"):
            await kv.client(model="").lookup([])  # an empty model name is refused
        too_many = prefix_keys(1) * (MAX_CHUNKS + 1)
        with pytest.raises(KVStoreRefused, match="more than 65536"):
            await kv.client().lookup(too_many)
        with pytest.raises(KVStoreRefused):
            await kv.client().request_finished("")
        assert await kv.client().lookup(prefix_keys(1)) == ["missing"]
