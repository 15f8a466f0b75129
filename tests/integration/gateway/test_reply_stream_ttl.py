"""The gateway's reply stream lives exactly as long as its gateway: created with a TTL, kept
alive by refreshes, re-created after Redis lost it, and gone by itself once nobody refreshes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.gateway.stream.bus_client import GatewayBusClient
from shared.bus import Bus
from shared.protocol import RequestDelta, TokenDelta
from shared.streams import Streams
from tests.integration.shared.test_bus import eventually

STREAMS = Streams("ttl")
TTL_S = 2


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[GatewayBusClient]:
    bus = Bus(redis_url, "gw-ttl")
    await bus.connect()
    client = GatewayBusClient(
        bus, STREAMS, "gw-ttl", max_pending=4, reply_stream_ttl_s=TTL_S, refresh_interval_s=0.05
    )
    await client.start()
    yield client
    await client.stop()
    await bus.close()


async def has_ttl(client: aioredis.Redis, stream: str) -> bool:
    return 0 < await client.ttl(stream) <= TTL_S


async def test_the_stream_exists_with_a_ttl_before_any_reply(
    gateway: GatewayBusClient, redis_client: aioredis.Redis
) -> None:
    await eventually(lambda: has_ttl(redis_client, gateway.reply_stream), "a reply stream TTL")
    assert await redis_client.xlen(gateway.reply_stream) == 0


async def test_a_live_gateway_keeps_its_stream_past_the_ttl_and_gets_it_back_after_a_flush(
    gateway: GatewayBusClient, redis_client: aioredis.Redis, redis_url: str
) -> None:
    stream = gateway.reply_stream
    await eventually(lambda: has_ttl(redis_client, stream), "a reply stream TTL")
    scheduler = Bus(redis_url, "scheduler")
    try:
        delta = RequestDelta(request_id="r", start_index=0, token_ids=[1])
        await scheduler.publish(stream, TokenDelta(scheduler_id="s", deltas=[delta]))
        await redis_client.flushall()  # Redis restarted empty, as far as the stream goes
        await eventually(lambda: has_ttl(redis_client, stream), "the stream re-created")
        # Refreshed all along: still there when three TTLs have run out.
        deadline = time.monotonic() + 3 * TTL_S
        while time.monotonic() < deadline:
            assert await redis_client.exists(stream)
            await asyncio.sleep(0.1)
    finally:
        await scheduler.close()


async def test_the_stream_of_a_gateway_that_stopped_refreshing_expires(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    bus = Bus(redis_url, "gw-dead")
    await bus.connect()
    client = GatewayBusClient(bus, STREAMS, "gw-dead", max_pending=1, reply_stream_ttl_s=1)
    await client.start()

    async def exists() -> bool:
        return bool(await redis_client.exists(client.reply_stream))

    async def gone() -> bool:
        return not await exists()

    await eventually(exists, "the reply stream")
    await client.stop()  # as if killed: nothing refreshes it any more
    await bus.close()
    await eventually(gone, "the stream to expire", 5)
