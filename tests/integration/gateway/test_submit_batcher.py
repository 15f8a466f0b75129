"""Submissions share Redis pipelines (services/gateway/stream/submit_batcher.py), on a real
Redis: a burst leaves in one pipeline with every caller's own ids, a refused entry fails only
its own caller, and through the gateway a burst of requests is all queued, in few pipelines,
while a refused one is a 503 that leaves nothing behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.gateway.stream.submit_batcher import SubmitBatcher
from shared.bus import Bus, PublishRefused
from shared.protocol import AbortRequest, Message, RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

WAIT_S = 10.0


def abort(i: int) -> AbortRequest:
    return AbortRequest(request_id=f"r{i}")


@pytest.fixture
async def bus(redis_url: str) -> AsyncIterator[Bus]:
    b = Bus(redis_url, consumer="gw")
    await b.connect()
    yield b
    await b.close()


async def stream_ids(redis_url: str, stream: str) -> list[str]:
    raw = aioredis.Redis.from_url(redis_url)
    try:
        return [eid.decode() for eid, _ in await raw.xrange(stream)]
    finally:
        await raw.aclose()


async def test_a_burst_leaves_in_one_pipeline_with_each_callers_ids(
    bus: Bus, redis_url: str
) -> None:
    batcher = SubmitBatcher(bus)
    calls: list[list[tuple[str, Message]]] = [
        [("s:a", abort(i)), ("s:b", abort(i))] if i % 2 else [("s:a", abort(i))] for i in range(10)
    ]
    async with asyncio.timeout(WAIT_S):
        got = await asyncio.gather(*(batcher.publish(c) for c in calls))
    assert batcher.pipelines == 1
    assert [len(ids) for ids in got] == [len(c) for c in calls]
    on_a = [ids[0] for ids in got]
    on_b = [ids[1] for ids in got if len(ids) == 2]
    assert on_a == await stream_ids(redis_url, "s:a")  # every caller's own, in call order
    assert on_b == await stream_ids(redis_url, "s:b")


async def test_calls_apart_in_time_each_leave_at_once(bus: Bus) -> None:
    batcher = SubmitBatcher(bus)
    async with asyncio.timeout(WAIT_S):
        first = await batcher.publish([("s:c", abort(1))])
        second = await batcher.publish([("s:c", abort(2))])
    assert batcher.pipelines == 2 and first < second


async def test_a_refused_entry_fails_only_its_own_caller(bus: Bus, redis_url: str) -> None:
    raw = aioredis.Redis.from_url(redis_url)
    await raw.set("s:not-a-stream", "x")  # XADD there is refused (WRONGTYPE)
    await raw.aclose()
    batcher = SubmitBatcher(bus)
    async with asyncio.timeout(WAIT_S):
        ok_before, refused, ok_after = await asyncio.gather(
            batcher.publish([("s:d", abort(1))]),
            batcher.publish([("s:d", abort(2)), ("s:not-a-stream", abort(3))]),
            batcher.publish([("s:d", abort(4))]),
            return_exceptions=True,
        )
    assert batcher.pipelines == 1
    assert isinstance(refused, PublishRefused)
    assert list(refused.errors) == [1] and refused.ids[0] is not None  # its own indices
    assert isinstance(ok_before, list) and isinstance(ok_after, list)
    assert [*ok_before, refused.ids[0], *ok_after] == await stream_ids(redis_url, "s:d")


async def test_a_stopped_sender_leaves_no_caller_waiting(bus: Bus, redis_url: str) -> None:
    """Cancelled with one pipeline on its way and a call waiting for the next (the loop is
    closing), the sender fails both callers rather than leaving them to wait for good."""
    raw = aioredis.Redis.from_url(redis_url)
    await raw.client_pause(10_000, all=False)  # writes wait: the first pipeline stays in flight
    try:
        batcher = SubmitBatcher(bus)
        first = asyncio.create_task(batcher.publish([("s:e", abort(1))]))
        while batcher.pipelines == 0:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(batcher.publish([("s:e", abort(2))]))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        assert batcher._sender is not None
        batcher._sender.cancel()
        async with asyncio.timeout(WAIT_S):
            results = await asyncio.gather(first, second, return_exceptions=True)
            await batcher.close()
        assert all(isinstance(r, ConnectionError) for r in results)
    finally:
        await raw.client_unpause()
        await raw.aclose()


async def test_a_burst_of_requests_is_queued_in_few_pipelines(gateway: GatewayHarness) -> None:
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 1}
    posts = [
        asyncio.create_task(gateway.http.post("/v1/completions", json=body)) for _ in range(32)
    ]
    subs = [await gateway.next_submit() for _ in range(32)]
    assert len({s.request_id for s in subs}) == 32
    assert gateway.frontend.client.submits.pipelines < 32
    await gateway.reply(
        *(
            RequestDelta(
                request_id=s.request_id, start_index=0, token_ids=[9], finish_reason="length"
            )
            for s in subs
        )
    )
    assert [r.status_code for r in await asyncio.gather(*posts)] == [200] * 32


async def test_a_refused_submission_is_a_503_and_nothing_stays_in_flight(
    gateway: GatewayHarness, redis_url: str
) -> None:
    raw = aioredis.Redis.from_url(redis_url)
    await raw.delete(gateway.streams.requests)
    await raw.set(gateway.streams.requests, "x")
    try:
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
        resp = await gateway.http.post("/v1/completions", json=body)
    finally:
        await raw.delete(gateway.streams.requests)
        await raw.aclose()
    assert resp.status_code == 503
    assert "the request queue refused the request" in resp.json()["error"]["message"]
    assert gateway.frontend.client.in_flight == 0
