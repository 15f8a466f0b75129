"""The gateway's heartbeat reader on a real Redis: it replays the stream's recent history (not
older entries), follows new beats, and dead-letters a malformed entry without stopping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.gateway.mesh.groups import ALIVE_INTERVALS, MeshView
from services.gateway.mesh.heartbeat_reader import HeartbeatReader
from shared.bus import Bus
from shared.codec import encode
from shared.protocol import Heartbeat
from shared.streams import Streams

S = Streams("mesh")
WAIT_S = 10.0


def beat(instance: str, t: float, ready: bool = True, interval_s: float = 100.0) -> Heartbeat:
    return Heartbeat(
        service="scheduler",
        instance_id=instance,
        incarnation="i",
        ready=ready,
        time=t,
        model="m",
        interval_s=interval_s,  # by default alive for the whole test
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


LAPSE_INTERVAL_S = 2.0


async def lapsed_reader(gateway: Bus, scheduler: Bus) -> HeartbeatReader:
    """A reader that has read one ready beat which left its alive window 0.1 s ago: its
    group has lapsed and is within its one interval of grace."""
    t = time.time() - ALIVE_INTERVALS * LAPSE_INTERVAL_S - 0.1
    await scheduler.publish(S.heartbeats, beat("s0", t, interval_s=LAPSE_INTERVAL_S))
    reader = HeartbeatReader(gateway, S.heartbeats, MeshView(1.0), history_s=60.0)
    reader.start()
    async with asyncio.timeout(WAIT_S):
        await reader.wait_for(lambda v: reader.beats_read == 1)
    return reader


async def test_a_lapsed_group_heard_again_within_its_grace_serves(
    buses: tuple[Bus, Bus],
) -> None:
    """A late beat (or a late reading of it) does not refuse a request: the reader waits for
    the lapsed group's next beat, up to one interval, and answers with it."""
    gateway, scheduler = buses
    reader = await lapsed_reader(gateway, scheduler)
    try:
        assert not reader.view.serving("m", time.time()).ok
        asking = asyncio.create_task(reader.serving("m"))
        await asyncio.sleep(0.2)
        assert not asking.done()  # held for the next beat, not refused
        await scheduler.publish(S.heartbeats, beat("s0", time.time(), interval_s=LAPSE_INTERVAL_S))
        async with asyncio.timeout(WAIT_S):
            serving = await asking
        assert serving.ok and serving.groups == ("0",)
    finally:
        await reader.stop()


async def test_a_lapsed_group_not_heard_again_is_refused_after_its_grace(
    buses: tuple[Bus, Bus],
) -> None:
    gateway, scheduler = buses
    reader = await lapsed_reader(gateway, scheduler)
    try:
        async with asyncio.timeout(WAIT_S):
            serving = await reader.serving("m")
        assert not serving.ok and "(0 schedulers alive)" in serving.reason
        # Its grace is spent: the next request is refused without waiting.
        asking = asyncio.create_task(reader.serving("m"))
        await asyncio.sleep(0)
        assert asking.done() and not asking.result().ok
    finally:
        await reader.stop()
