"""The gateway's heartbeat reader on a real Redis: it replays the stream's recent history (not
older entries), follows new beats, and dead-letters a malformed entry without stopping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.gateway.mesh.groups import MeshView
from services.gateway.mesh.heartbeat_reader import HeartbeatReader
from shared.bus import Bus
from shared.codec import encode
from shared.protocol import Heartbeat
from shared.streams import Streams

S = Streams("mesh")
WAIT_S = 10.0


def beat(instance: str, t: float, ready: bool = True) -> Heartbeat:
    return Heartbeat(
        service="scheduler",
        instance_id=instance,
        incarnation="i",
        ready=ready,
        time=t,
        model="m",
        interval_s=100.0,  # alive for the whole test, whenever it was published
    )


@pytest.fixture
async def buses(redis_url: str) -> AsyncIterator[tuple[Bus, Bus]]:
    gateway = Bus(redis_url, consumer="gw", dead_letter_stream=S.deadletter)
    scheduler = Bus(redis_url, consumer="sched")
    await gateway.connect()
    await scheduler.connect()
    yield gateway, scheduler
    await gateway.close()
    await scheduler.close()


async def seen(reader: HeartbeatReader, *instances: str) -> None:
    now = time.time()
    async with asyncio.timeout(WAIT_S):
        await reader.wait_for(
            lambda v: {r.instance_id for r in v.schedulers(now)} >= set(instances)
        )


async def test_recent_history_is_replayed_and_older_entries_are_not(
    buses: tuple[Bus, Bus], redis_url: str
) -> None:
    gateway, scheduler = buses
    now = time.time()
    raw = aioredis.Redis.from_url(redis_url)
    # An entry from before the history window (explicit id, Redis' ms clock), then a recent one.
    old_id = f"{int((now - 120) * 1000)}-0"
    await raw.xadd(S.heartbeats, {"m": encode(beat("old", now - 120))}, id=old_id)
    await raw.aclose()
    await scheduler.publish(S.heartbeats, beat("recent", now))

    reader = HeartbeatReader(gateway, S.heartbeats, MeshView(1.0), history_s=60.0)
    reader.start()
    try:
        await seen(reader, "recent")
        assert reader.beats_read == 1  # "old" was not read at all
        await scheduler.publish(S.heartbeats, beat("later", time.time()))
        await seen(reader, "recent", "later")
        assert reader.view.serving("m", time.time()).groups == ("0",)
    finally:
        await reader.stop()


async def test_a_malformed_entry_is_dead_lettered_and_reading_goes_on(
    buses: tuple[Bus, Bus], redis_url: str
) -> None:
    gateway, scheduler = buses
    raw = aioredis.Redis.from_url(redis_url)
    await raw.xadd(S.heartbeats, {"m": b"\xc1 not msgpack"})
    await scheduler.publish(S.heartbeats, beat("s0", time.time()))
    reader = HeartbeatReader(gateway, S.heartbeats, MeshView(1.0), history_s=60.0)
    reader.start()
    try:
        await seen(reader, "s0")
        dead = await raw.xrange(S.deadletter)
        assert len(dead) == 1 and dead[0][1][b"reason"] == b"malformed"
    finally:
        await reader.stop()
        await raw.aclose()
