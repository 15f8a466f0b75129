"""The bus against a real redis-server: groups, trimming, claims, dead letters, restarts."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgpack
import pytest
import redis
from prometheus_client import REGISTRY
from redis.exceptions import AuthenticationError, ResponseError

from shared.bus import Bus, BusUnavailable, Delivery
from shared.codec import encode
from shared.protocol import AbortRequest, Message
from tests.support.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[3]
STREAM = "meshllm:test:requests"
GROUP = "schedulers"
DEAD = "meshllm:test:deadletter"


def abort(n: int) -> AbortRequest:
    return AbortRequest(request_id=f"req-{n}")


def messages(deliveries: list[Delivery]) -> list[Message]:
    return [d.message for d in deliveries]


async def eventually(check: Callable[[], Awaitable[bool] | bool], what: str, limit_s: float = 10):
    """Poll `check` until true; fail after `limit_s` (a deadline, never a fixed wait)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        result = check()
        if await result if isinstance(result, Awaitable) else result:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


async def read_until(bus: Bus, want: int, **kwargs: object) -> list[Delivery]:
    got: list[Delivery] = []

    async def more() -> bool:
        got.extend(await bus.read_group(GROUP, [STREAM], block_ms=100, **kwargs))  # type: ignore[arg-type]
        return len(got) >= want

    await eventually(more, f"{want} deliveries")
    return got


def pending(url: str, stream: str = STREAM) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.xpending(stream, GROUP)["pending"])
    finally:
        client.close()


def dead_letter_count(stream: str, reason: str) -> float:
    labels = {"stream": stream, "reason": reason}
    return REGISTRY.get_sample_value("meshllm:bus_dead_letters_total", labels) or 0.0


@pytest.fixture
async def bus(redis_url: str) -> AsyncIterator[Bus]:
    bus = Bus(redis_url, "consumer-a", dead_letter_stream=DEAD)
    await bus.connect()
    yield bus
    await bus.close()


async def test_publish_read_ack(bus: Bus, redis_url: str) -> None:
    await bus.ensure_group(STREAM, GROUP)
    sent = [abort(i) for i in range(3)]
    ids = [await bus.publish(STREAM, m) for m in sent]

    got = await bus.read_group(GROUP, [STREAM], block_ms=1000)
    assert messages(got) == sent
    assert [d.entry_id for d in got] == ids
    assert {d.stream for d in got} == {STREAM}
    assert pending(redis_url) == 3

    await bus.ack(GROUP, got[:2])
    assert pending(redis_url) == 1
    # An acked entry is done: deleted, so the stream holds only what is still pending.
    assert await bus.redis.xlen(STREAM) == 1
    await bus.ack(GROUP, got[2:])
    assert pending(redis_url) == 0 and await bus.redis.xlen(STREAM) == 0
    assert await bus.read_group(GROUP, [STREAM], block_ms=None) == []


async def test_publish_many_keeps_order_across_streams(bus: Bus) -> None:
    other = STREAM + ":other"
    items: list[tuple[str, Message]] = [(STREAM if i % 2 else other, abort(i)) for i in range(6)]
    ids = await bus.publish_many(items)
    assert len(ids) == 6
    last_ids = {STREAM: "0", other: "0"}
    got = await bus.read(last_ids, block_ms=None)
    by_stream = {s: [d.message for d in got if d.stream == s] for s in (STREAM, other)}
    assert by_stream[STREAM] == [m for s, m in items if s == STREAM]
    assert by_stream[other] == [m for s, m in items if s == other]
    assert last_ids == {STREAM: ids[-1], other: ids[-2]}
    assert await bus.publish_many([]) == []


async def test_maxlen_trims_the_stream(redis_url: str) -> None:
    bus = Bus(redis_url, "producer", maxlen=100)
    try:
        for _ in range(10):
            await bus.publish_many([(STREAM, abort(i)) for i in range(200)])
        length = await bus.redis.xlen(STREAM)
    finally:
        await bus.close()
    # Approximate trimming drops whole radix-tree nodes (100 entries each by default), so the
    # stream keeps at least maxlen and less than maxlen plus one node.
    assert 100 <= length < 200


async def test_fan_out_streams_keep_their_retention_and_group_streams_their_maxlen(
    redis_url: str,
) -> None:
    """Fan-out streams are trimmed by age (XADD MINID): 300 entries an hour old go, new ones
    stay; a stream read through a group is never trimmed by age (its pending entries are
    requests in progress), only by length."""
    fan_out, grouped = "meshllm:test:{g0}:steps", STREAM
    old_ms = int((time.time() - 3600) * 1000)
    bus = Bus(redis_url, "producer", maxlen=1000, retention_s=60)
    try:
        for stream in (fan_out, grouped):
            pipe = bus.redis.pipeline(transaction=False)
            for i in range(300):
                pipe.xadd(stream, {"m": encode(abort(i))}, id=f"{old_ms}-{i}")
            await pipe.execute()
            await bus.publish_many([(stream, abort(1000 + i)) for i in range(5)])
        # Approximate trimming drops whole nodes (100 entries): the old ones of the last node
        # may stay until the next XADD past them.
        assert await bus.redis.xlen(fan_out) < 105
        newest = await bus.redis.xrevrange(fan_out, count=5)
        assert [int(entry_id.split(b"-")[0]) > old_ms for entry_id, _ in newest] == [True] * 5
        assert await bus.redis.xlen(grouped) == 305
    finally:
        await bus.close()


async def test_a_live_consumer_claims_what_a_killed_one_left_pending(
    bus: Bus, redis_url: str
) -> None:
    await bus.ensure_group(STREAM, GROUP)
    sent = abort(1)
    entry_id = await bus.publish(STREAM, sent)
    doomed = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.stalled_consumer",
            redis_url,
            STREAM,
            GROUP,
            "doomed",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert doomed.stdout is not None
        read_id = await asyncio.wait_for(asyncio.to_thread(doomed.stdout.readline), 30)
        assert read_id.strip() == entry_id
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
    assert doomed.returncode == -signal.SIGKILL
    assert await bus.read_group(GROUP, [STREAM], block_ms=None) == []  # not new any more

    claimed: list[Delivery] = []

    async def claim() -> bool:
        claimed.extend(await bus.claim_idle(STREAM, GROUP, min_idle_ms=50))
        return bool(claimed)

    await eventually(claim, "the dead consumer's entry to be claimable")
    assert [(d.entry_id, d.message) for d in claimed] == [(entry_id, sent)]
    info = await bus.redis.xpending_range(STREAM, GROUP, min="-", max="+", count=10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in info] == [
        (entry_id, "consumer-a")
    ]
    await bus.ack(GROUP, claimed)
    assert pending(redis_url) == 0


async def test_bad_entries_are_dead_lettered_and_the_consumer_goes_on(
    bus: Bus, redis_url: str
) -> None:
    await bus.ensure_group(STREAM, GROUP)
    wrong_schema = msgpack.packb({"t": "submit", "v": 1, "b": {"request_id": "x"}})
    huge_garbage = b"\xc1" * (100 * 1024)
    bad = {
        "malformed": await bus.redis.xadd(STREAM, {"m": b"\xc1\x00garbage"}),
        "invalid": await bus.redis.xadd(STREAM, {"m": wrong_schema}),
        "missing_field": await bus.redis.xadd(STREAM, {"payload": b"hello"}),
    }
    huge_id = await bus.redis.xadd(STREAM, {"m": huge_garbage})
    valid = abort(7)
    await bus.publish(STREAM, valid)
    before = {r: dead_letter_count(STREAM, r) for r in bad}

    got = await read_until(bus, 1, count=1)  # one entry per read: four reads yield nothing
    assert messages(got) == [valid]

    records = [fields for _, fields in await bus.redis.xrange(DEAD)]
    assert [(r[b"id"].decode(), r[b"reason"].decode()) for r in records] == [
        (bad["malformed"].decode(), "malformed"),
        (bad["invalid"].decode(), "invalid"),
        (bad["missing_field"].decode(), "missing_field"),
        (huge_id.decode(), "malformed"),
    ]
    assert {r[b"stream"] for r in records} == {STREAM.encode()}
    assert {r[b"consumer"] for r in records} == {b"consumer-a"}
    assert records[0][b"payload"] == b"\xc1\x00garbage"
    assert records[1][b"payload"] == wrong_schema
    assert b"prompt_token_ids" in records[1][b"detail"]
    assert records[3][b"payload"] == huge_garbage[: 64 * 1024]
    assert float(records[0][b"time"]) > 0
    after = {r: dead_letter_count(STREAM, r) for r in bad}
    assert after["malformed"] == before["malformed"] + 2
    assert after["invalid"] == before["invalid"] + 1
    assert after["missing_field"] == before["missing_field"] + 1
    assert pending(redis_url) == 1  # the bad entries were acked; only the valid one waits


async def test_fan_out_read_skips_bad_entries_and_advances_past_them(bus: Bus) -> None:
    last_ids = {STREAM: "0"}
    await bus.redis.xadd(STREAM, {"m": b"not msgpack \xc1"})
    newest = await bus.redis.xadd(STREAM, {"m": encode(abort(1))[:-1]})  # truncated
    assert await bus.read(last_ids, block_ms=None) == []
    assert last_ids[STREAM] == newest.decode()
    assert await bus.redis.xlen(DEAD) == 2
    await bus.publish(STREAM, abort(2))
    assert messages(await bus.read(last_ids, block_ms=1000)) == [abort(2)]


async def test_fan_out_from_dollar_misses_nothing_between_calls(bus: Bus, redis_url: str) -> None:
    await bus.publish(STREAM, abort(0))  # history that "$" must skip
    other = Bus(redis_url, "consumer-b")
    try:
        mine, theirs = {STREAM: "$"}, {STREAM: "$"}
        assert await bus.read(mine, block_ms=None) == []
        assert await other.read(theirs, block_ms=None) == []
        # Published between two reads: a literal "$" on the next XREAD would not see these.
        await bus.publish_many([(STREAM, abort(1)), (STREAM, abort(2))])
        assert messages(await bus.read(mine, block_ms=1000)) == [abort(1), abort(2)]
        assert messages(await other.read(theirs, block_ms=1000)) == [abort(1), abort(2)]
    finally:
        await other.close()


async def test_own_pending_rereads_unacked_entries_after_a_consumer_restart(
    redis_url: str,
) -> None:
    first = Bus(redis_url, "scheduler-1")
    await first.ensure_group(STREAM, GROUP)
    await first.publish_many([(STREAM, abort(i)) for i in range(3)])
    read = await first.read_group(GROUP, [STREAM], block_ms=1000)
    await first.ack(GROUP, read[:1])
    await first.close()

    again = Bus(redis_url, "scheduler-1")
    try:
        assert await again.read_group(GROUP, [STREAM], block_ms=None) == []  # none are new
        redelivered = await again.read_group(GROUP, [STREAM], own_pending=True)
        assert [(d.entry_id, d.message) for d in redelivered] == [
            (d.entry_id, d.message) for d in read[1:]
        ]
        await again.ack(GROUP, redelivered)
        assert await again.read_group(GROUP, [STREAM], own_pending=True) == []
    finally:
        await again.close()


async def test_pending_entries_trimmed_away_are_acked_and_skipped(bus: Bus, redis_url: str) -> None:
    await bus.ensure_group(STREAM, GROUP)
    await bus.publish_many([(STREAM, abort(i)) for i in range(3)])
    assert len(await bus.read_group(GROUP, [STREAM], block_ms=1000)) == 3
    await bus.redis.xtrim(STREAM, maxlen=0, approximate=False)
    assert await bus.read_group(GROUP, [STREAM], own_pending=True) == []
    assert pending(redis_url) == 0
    assert await bus.redis.xlen(DEAD) == 0  # trimmed is not malformed


async def test_reading_a_group_never_ensured_is_an_error(bus: Bus) -> None:
    with pytest.raises(ResponseError, match="NOGROUP"):
        await bus.read_group("nobody", [STREAM], block_ms=None)
    with pytest.raises(ValueError, match="block_ms"):
        await bus.read_group(GROUP, [STREAM], block_ms=0)


async def redis_has_blocked_reader(url: str) -> bool:
    client = redis.asyncio.Redis.from_url(url)
    try:
        clients = await client.client_list()
    finally:
        await client.aclose()
    return any(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in clients)


async def test_a_blocked_read_survives_a_redis_restart(own_redis: RedisServer) -> None:
    bus = Bus(own_redis.url, "consumer-a", dead_letter_stream=DEAD)
    try:
        await bus.connect()
        await bus.ensure_group(STREAM, GROUP)
        await bus.publish(STREAM, abort(1))
        before = await bus.read_group(GROUP, [STREAM], block_ms=1000)
        assert messages(before) == [abort(1)]

        reader = asyncio.create_task(bus.read_group(GROUP, [STREAM], block_ms=30_000))
        await eventually(lambda: redis_has_blocked_reader(own_redis.url), "a blocked XREADGROUP")
        await asyncio.to_thread(own_redis.restart)  # empty: no persistence, so no group either

        await bus.publish(STREAM, abort(2))
        after = await asyncio.wait_for(reader, 30)
        assert messages(after) == [abort(2)]
        await bus.ack(GROUP, before)  # its group is gone with the old Redis: harmless
        await bus.ack(GROUP, after)
        assert pending(own_redis.url) == 0
    finally:
        await bus.close()


async def test_a_stream_deleted_under_a_blocked_read_is_recreated(redis_url: str) -> None:
    """FLUSHALL (or a DEL) while a group read blocks unblocks it with an error: the bus
    recreates the group and reads on."""
    bus = Bus(redis_url, "consumer-a", dead_letter_stream=DEAD)
    try:
        await bus.connect()
        await bus.ensure_group(STREAM, GROUP)
        reader = asyncio.create_task(bus.read_group(GROUP, [STREAM], block_ms=30_000))
        await eventually(lambda: redis_has_blocked_reader(redis_url), "a blocked XREADGROUP")
        await bus.redis.delete(STREAM)
        await eventually(lambda: bus.redis.exists(STREAM), "the group recreated")
        await bus.publish(STREAM, abort(3))
        assert messages(await asyncio.wait_for(reader, 30)) == [abort(3)]
    finally:
        await bus.close()


async def test_publish_waits_for_redis_to_come_back(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="shared.bus")
    bus = Bus(own_redis.url, "producer")
    try:
        await bus.connect()
        own_redis.stop()
        publishing = asyncio.create_task(bus.publish(STREAM, abort(1)))
        await eventually(
            lambda: any("unreachable" in r.getMessage() for r in caplog.records),
            "the publish to hit the outage",
        )
        await asyncio.to_thread(own_redis.start)
        entry_id = await asyncio.wait_for(publishing, 30)
        assert [i.decode() for i, _ in await bus.redis.xrange(STREAM)] == [entry_id]
    finally:
        await bus.close()


async def test_publish_gives_up_after_its_timeout(own_redis: RedisServer) -> None:
    bus = Bus(own_redis.url, "producer", publish_timeout_s=0.3)
    try:
        await bus.connect()
        own_redis.stop()
        with pytest.raises(BusUnavailable, match="publish"):
            await bus.publish(STREAM, abort(1))
    finally:
        await bus.close()


async def test_a_read_on_a_frozen_redis_times_out_and_retries(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopped (SIGSTOP) Redis keeps its sockets open and never answers: only the bus's own
    deadline can notice. The read must give up on that connection and retry, not hang."""
    caplog.set_level(logging.WARNING, logger="shared.bus")
    bus = Bus(own_redis.url, "consumer-a", op_timeout_s=0.3)
    assert own_redis.proc is not None
    try:
        await bus.ensure_group(STREAM, GROUP)
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            reader = asyncio.create_task(bus.read_group(GROUP, [STREAM], block_ms=100))
            await eventually(
                lambda: any("during read_group" in r.getMessage() for r in caplog.records),
                "the read to hit its deadline",
            )
            assert not reader.done()
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        got = await asyncio.wait_for(reader, 30)  # empty: its BLOCK ran out on the new connection
        await bus.publish(STREAM, abort(1))
        got += await read_until(bus, 1)
        assert messages(got) == [abort(1)]
    finally:
        await bus.close()


async def test_a_refused_login_fails_at_once_instead_of_retrying() -> None:
    server = RedisServer(extra_args=["--requirepass", "right"]).start()
    bus = Bus(f"redis://:wrong@127.0.0.1:{server.port}/0", "consumer-a", connect_timeout_s=60)
    try:
        with pytest.raises(AuthenticationError):  # not BusUnavailable after a minute of retries
            await bus.connect()
    finally:
        await bus.close()
        server.stop()
