"""The kvstore service against a real Redis: eviction deletes payload and metadata together,
metadata rebuilds the tier after a restart, failed writes leave nothing behind."""

from __future__ import annotations

from typing import Any

import httpx
import redis.asyncio as aioredis

from shared.kv.offload_key import OffloadKey
from tests.integration.kvstore.running import MODEL, NBYTES, SPACE, kvstore
from tests.unit.kvstore.prefix import prefix_chunks


def ref(key: OffloadKey) -> dict[str, Any]:
    return {"group": key.group, "hash": key.block_hash.hex()}


def offer(key: OffloadKey, end: int) -> dict[str, Any]:
    return {**ref(key), "end": end, "nbytes": NBYTES}


async def post(client: httpx.AsyncClient, path: str, **body: Any) -> dict[str, Any]:
    if path != "request_finished":
        body = {"model": MODEL, **body}
    resp = await client.post(f"/v1/kv/{path}", json=body)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def store_prefix(
    client: httpx.AsyncClient, r: aioredis.Redis, request_id: str, chunks
) -> None:
    """What the scheduler + worker do: offer, write the payloads, report, finish."""
    plan = await post(
        client, "store", request_id=request_id, chunks=[offer(k, e) for k, e in chunks]
    )
    assert plan["write"] == [ref(k) for k, _ in chunks]
    for key, _ in chunks:
        await r.set(SPACE.payload_key(key), b"\x01" * NBYTES)  # the worker's write
    done = await post(client, "stored", chunks=[offer(k, e) for k, e in chunks], ok=True)
    assert done == {"completed": len(chunks)}
    await post(client, "request_finished", request_id=request_id)


async def exists(r: aioredis.Redis, key: OffloadKey) -> tuple[bool, bool]:
    return (
        bool(await r.exists(SPACE.payload_key(key))),
        bool(await r.exists(SPACE.meta_key(key))),
    )


async def test_eviction_deletes_payload_and_metadata_together(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    old = prefix_chunks(2, seed=1)
    new = prefix_chunks(1, seed=2)
    async with kvstore(redis_url, capacity_chunks=2) as client:
        await store_prefix(client, r, "r1", old)
        meta = await r.hgetall(SPACE.meta_key(old[0][0]))
        assert meta[b"nbytes"] == b"100" and meta[b"end"] == b"16"
        plan = await post(client, "store", request_id="r2", chunks=[offer(*new[0])])
        assert plan["write"] == [ref(new[0][0])] and plan["evicted"] == 1
        # r1's tail went first (its head is the most recent): payload and metadata both gone.
        assert await exists(r, old[1][0]) == (False, False)
        assert await exists(r, old[0][0]) == (True, True)
        statuses = await post(client, "lookup", chunks=[ref(k) for k, _ in [*old, *new]])
        assert statuses == {"statuses": ["ready", "missing", "writing"]}
        state = (await client.get("/admin/state")).json()["kvstore"]
        assert state["chunks"] == 2 and state["evictions"] == 1 and state["undeleted"] == 0
        assert state["used_bytes"] == 2 * NBYTES
    await r.aclose()


async def test_pinned_chunks_are_not_evicted_and_refusal_deletes_nothing(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    old = prefix_chunks(1, seed=1)
    new = prefix_chunks(1, seed=2)
    async with kvstore(redis_url, capacity_chunks=1) as client:
        await store_prefix(client, r, "r1", old)
        pinned = await post(client, "load", holder="r2", chunks=[ref(old[0][0]) | {"end": 16}])
        assert pinned == {"pinned": [ref(old[0][0])]}
        plan = await post(client, "store", request_id="r3", chunks=[offer(*new[0])])
        assert plan["refused"] == [ref(new[0][0])] and plan["evicted"] == 0
        assert await exists(r, old[0][0]) == (True, True)
        assert await post(client, "loaded", holder="r2", chunks=[ref(old[0][0])]) == {"released": 1}
        plan = await post(client, "store", request_id="r3", chunks=[offer(*new[0])])
        assert plan["evicted"] == 1 and await exists(r, old[0][0]) == (False, False)
    await r.aclose()


async def test_failed_write_leaves_no_payload_and_no_metadata(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    ((key, end),) = prefix_chunks(1)
    async with kvstore(redis_url, capacity_chunks=4) as client:
        await post(client, "store", request_id="r1", chunks=[offer(key, end)])
        await r.set(SPACE.payload_key(key), b"partial")
        assert await post(client, "stored", chunks=[offer(key, end)], ok=False) == {"completed": 1}
        assert await exists(r, key) == (False, False)
        assert (await post(client, "lookup", chunks=[ref(key)]))["statuses"] == ["missing"]
    await r.aclose()


async def test_restart_rebuilds_the_tier_from_metadata(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    first = prefix_chunks(2, seed=1)
    second = prefix_chunks(1, seed=2)
    async with kvstore(redis_url, capacity_chunks=4) as client:
        await store_prefix(client, r, "r1", first)
        await store_prefix(client, r, "r2", second)
        # A chunk still being written at shutdown has no metadata: it is not recovered.
        await post(client, "store", request_id="r3", chunks=[offer(*prefix_chunks(1, seed=3)[0])])
    await r.delete(SPACE.payload_key(first[1][0]))  # a payload lost behind the kvstore's back
    async with kvstore(redis_url, capacity_chunks=4) as client:
        state = (await client.get("/admin/state")).json()["kvstore"]
        assert state["recovered"] == 2 and state["ready"] == 2 and state["writing"] == 0
        statuses = await post(client, "lookup", chunks=[ref(k) for k, _ in [*first, *second]])
        assert statuses["statuses"] == ["ready", "missing", "ready"]
        assert await exists(r, first[1][0]) == (False, False)  # its dangling metadata removed
        # Recovered chunks keep their store order: the older one is evicted first.
        newest = prefix_chunks(3, seed=4)
        plan = await post(client, "store", request_id="r4", chunks=[offer(k, e) for k, e in newest])
        assert plan["evicted"] == 1
        assert await exists(r, first[0][0]) == (False, False)
        assert await exists(r, second[0][0]) == (True, True)
    await r.aclose()


async def test_malformed_bodies_get_422_with_a_message(redis_url: str) -> None:
    async with kvstore(redis_url, capacity_chunks=1) as client:
        bad = [
            ("lookup", {"model": MODEL, "chunks": [{"group": 0, "hash": "xyz"}]}),
            ("lookup", {"chunks": []}),
            (
                "store",
                {
                    "model": MODEL,
                    "request_id": "r",
                    "chunks": [{"group": -1, "hash": "00" * 16, "end": 16, "nbytes": 1}],
                },
            ),
            (
                "load",
                {
                    "model": MODEL,
                    "holder": "r",
                    "chunks": [{"group": 0, "hash": "00" * 16, "end": 0}],
                },
            ),
            ("request_finished", {}),
        ]
        for path, body in bad:
            resp = await client.post(f"/v1/kv/{path}", json=body)
            assert resp.status_code == 422, (path, resp.text)
            assert resp.json()["detail"]
