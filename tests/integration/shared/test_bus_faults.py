"""The bus against a real redis-server when things go wrong: deleted streams, entries a consumer
keeps failing on, refused writes, outages longer than the publish timeout."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis

from shared.bus import Bus, PublishRefused
from shared.bus_entry import Rejected
from shared.codec import decode
from shared.protocol import AbortRequest
from tests.integration.shared.test_bus import (
    DEAD,
    GROUP,
    STREAM,
    abort,
    eventually,
    messages,
    pending,
    read_until,
    redis_has_blocked_reader,
)
from tests.support.redis_server import RedisServer


@pytest.fixture
async def bus(redis_url: str) -> AsyncIterator[Bus]:
    bus = Bus(redis_url, "consumer-a", dead_letter_stream=DEAD)
    await bus.connect()
    yield bus
    await bus.close()


async def test_a_blocked_group_read_survives_a_del_of_its_stream(bus: Bus, redis_url: str) -> None:
    """Redis unblocks the read with an UNBLOCKED error; the bus recreates the group instead of
    handing the error to the consumer (whose intake would die)."""
    await bus.ensure_group(STREAM, GROUP)
    reader = asyncio.create_task(bus.read_group(GROUP, [STREAM], block_ms=30_000))
    await eventually(lambda: redis_has_blocked_reader(redis_url), "a blocked XREADGROUP")
    await bus.redis.delete(STREAM)
    await bus.publish(STREAM, abort(1))  # into the new stream, before or after the new group
    assert messages(await asyncio.wait_for(reader, 30)) == [abort(1)]


async def test_claims_and_acks_survive_a_del_of_their_stream(bus: Bus) -> None:
    await bus.ensure_group(STREAM, GROUP)
    await bus.publish(STREAM, abort(1))
    got = await read_until(bus, 1)
    await bus.redis.delete(STREAM)
    await bus.ack(GROUP, got)  # its entry is gone: nothing to do, nothing raised
    assert await bus.claim_idle(STREAM, GROUP, min_idle_ms=0) == []
    await bus.publish(STREAM, abort(2))
    assert messages(await read_until(bus, 1)) == [abort(2)]


async def test_redelivered_entries_carry_their_delivery_count(bus: Bus, redis_url: str) -> None:
    await bus.ensure_group(STREAM, GROUP)
    await bus.publish(STREAM, abort(1))
    first = await read_until(bus, 1)
    assert first[0].deliveries == 1
    again = await bus.read_group(GROUP, [STREAM], own_pending=True)
    assert [d.deliveries for d in again] == [2]
    other = Bus(redis_url, "consumer-b")
    try:
        claimed = await other.claim_idle(STREAM, GROUP, min_idle_ms=0)
        assert [(d.entry_id, d.deliveries) for d in claimed] == [(first[0].entry_id, 3)]
    finally:
        await other.close()


async def test_dead_letter_records_the_reason_and_acks(bus: Bus, redis_url: str) -> None:
    await bus.ensure_group(STREAM, GROUP)
    await bus.publish(STREAM, abort(7))
    (delivery,) = await read_until(bus, 1)
    await bus.dead_letter(GROUP, [(delivery, "handler_error", "ValueError: boom")])
    assert pending(redis_url) == 0
    client = redis.Redis.from_url(redis_url)
    try:
        ((_, record),) = client.xrange(DEAD)
    finally:
        client.close()
    assert record[b"reason"] == b"handler_error"
    assert record[b"detail"] == b"ValueError: boom"
    assert record[b"id"] == delivery.entry_id.encode()
    assert decode(record[b"payload"]) == abort(7)  # re-encoded: it can be replayed


async def test_undecodable_entries_reach_the_rejection_watcher(bus: Bus) -> None:
    seen: list[Rejected] = []
    bus.watch_rejections(STREAM, seen.append)
    await bus.ensure_group(STREAM, GROUP)
    await bus.redis.xadd(STREAM, {"m": b"\xc1garbage"})
    await bus.publish(STREAM, abort(1))
    assert messages(await read_until(bus, 1)) == [abort(1)]
    assert [(r.reason, r.payload) for r in seen] == [("malformed", b"\xc1garbage")]


async def test_a_batch_with_a_refused_entry_writes_the_others(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser(
        "limited", enabled=True, passwords=["+pw"], keys=["meshllm:test:*"], commands=["+@all"]
    )
    admin.close()
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    bus = Bus(f"redis://limited:pw@127.0.0.1:{port}/0", "producer")
    try:
        items = [(STREAM, abort(1)), ("elsewhere:stream", abort(2)), (STREAM, abort(3))]
        with pytest.raises(PublishRefused) as refused:
            await bus.publish_many(items)  # type: ignore[arg-type]
        assert list(refused.value.errors) == [1]
        ids = refused.value.ids
        assert ids[1] is None and ids[0] is not None and ids[2] is not None
        written = await bus.redis.xrange(STREAM)
        assert [i.decode() for i, _ in written] == [ids[0], ids[2]]
    finally:
        await bus.close()


async def test_a_patient_publish_outlasts_the_publish_timeout(own_redis: RedisServer) -> None:
    bus = Bus(own_redis.url, "producer", publish_timeout_s=0.2)
    try:
        await bus.connect()
        own_redis.stop()
        publishing = asyncio.create_task(bus.publish(STREAM, abort(1), patient=True))
        await asyncio.sleep(1.0)  # five publish timeouts: an outage, not a pinned interleaving
        assert not publishing.done()
        await asyncio.to_thread(own_redis.start)
        entry_id = await asyncio.wait_for(publishing, 30)
        assert [i.decode() for i, _ in await bus.redis.xrange(STREAM)] == [entry_id]
    finally:
        await bus.close()


async def test_publish_if_exists_never_creates_the_stream(bus: Bus) -> None:
    assert await bus.publish_if_exists(STREAM, abort(1)) is None
    assert await bus.redis.exists(STREAM) == 0
    first = await bus.publish(STREAM, abort(2))
    second = await bus.publish_if_exists(STREAM, abort(3))
    assert second is not None and second > first
    assert [decode(f[b"m"]) for _, f in await bus.redis.xrange(STREAM)] == [
        AbortRequest(request_id="req-2"),
        AbortRequest(request_id="req-3"),
    ]


async def test_publish_many_gives_a_recreated_stream_an_expiry_and_keeps_a_set_one(
    bus: Bus,
) -> None:
    """A reply stream whose reader died expired; the next write re-creates it with an expiry
    (it would otherwise stay for good), while a live reader's longer expiry is left alone."""
    other = STREAM + ":other"
    await bus.publish(other, abort(0))
    await bus.redis.expire(other, 1000)
    await bus.publish_many(
        [(STREAM, abort(1)), (other, abort(2))], expire_if_unset={STREAM: 30, other: 30}
    )
    assert 0 < await bus.redis.ttl(STREAM) <= 30
    assert await bus.redis.ttl(other) > 900
    await bus.publish_many([(STREAM + ":plain", abort(3))])
    assert await bus.redis.ttl(STREAM + ":plain") == -1
