"""shared.rpc against a real redis-server: round trips, timeouts, error answers, dead letters,
retries, claims, reply-stream expiry. Concurrency is pinned with events, never sleeps.

The calls are real protocol messages served by the test's own handlers: a CompileGrammar whose
spec the handler echoes back as the GrammarCompiled key (the layer under test never looks
inside a call)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from shared.bus import Bus
from shared.protocol import (
    AbortRequest,
    CompileGrammar,
    GrammarCompiled,
    KVStats,
    Ping,
    Pong,
    RpcReply,
)
from shared.rpc import RpcClient, RpcError, RpcServer, RpcTimeout, RpcUnavailable
from shared.rpc.server import REPLY_TTL_S
from shared.streams import RPC_GROUP, Streams

S = Streams("rpct")
CALLS = S.calls("echo")
REPLIES = S.rpc_replies("tester", "t-1")


Echo = CompileGrammar
Echoed = GrammarCompiled
Handler = Callable[[Echo], Awaitable[RpcReply]]


def ask(text: str) -> Echo:
    return Echo(kind="regex", spec=text)


def echoed(text: str) -> Echoed:
    return Echoed(
        key=text, kind="regex", source="memory", compiled_bytes=0, tokenizer_hash="",
        xgrammar_version="",
    )  # fmt: skip


def served(type_: str, outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "meshllm:rpc_served_total", {"type": type_, "outcome": outcome}
    )
    return value or 0.0


def dropped() -> float:
    return REGISTRY.get_sample_value("meshllm:rpc_dropped_replies_total") or 0.0


async def echo(req: Echo) -> Echoed:
    return echoed(req.spec)


@asynccontextmanager
async def bus(redis_url: str, name: str) -> AsyncIterator[Bus]:
    b = Bus(redis_url, name, dead_letter_stream=S.deadletter)
    await b.connect()
    try:
        yield b
    finally:
        await b.close()


@asynccontextmanager
async def client(redis_url: str, reply_stream: str = REPLIES) -> AsyncIterator[RpcClient]:
    async with bus(redis_url, "caller") as b:
        c = RpcClient(b, reply_stream, S.rpc_reply_prefix)
        await c.start()
        try:
            yield c
        finally:
            await c.stop()


@asynccontextmanager
async def server(
    redis_url: str, handler: Handler = echo, name: str = "echo-1", **options: Any
) -> AsyncIterator[RpcServer]:
    async with bus(redis_url, name) as b:
        srv = RpcServer(
            b,
            CALLS,
            {Echo: handler},
            service="echo",
            instance_id=name,
            reply_prefix=S.rpc_reply_prefix,
            **options,
        )
        await srv.start()
        stopping = asyncio.Event()
        task = asyncio.create_task(srv.run(stopping))
        try:
            yield srv
        finally:
            stopping.set()
            await asyncio.wait_for(task, 10)


async def test_round_trip_and_concurrent_calls_get_their_own_answers(redis_url: str) -> None:
    async with server(redis_url), client(redis_url) as c:
        reply = await c.call(CALLS, ask("hi"), Echoed, timeout_s=5)
        assert reply.key == "hi" and reply.correlation_id
        replies = await asyncio.gather(
            *(c.call(CALLS, ask(f"m{i}"), Echoed, timeout_s=5) for i in range(50))
        )
        assert [r.key for r in replies] == [f"m{i}" for i in range(50)]
        assert len({r.correlation_id for r in replies}) == 50
        pong = await c.call(CALLS, Ping(), Pong, timeout_s=5)  # answered by the server itself
        assert (pong.service, pong.instance_id) == ("echo", "echo-1")
        assert c.in_flight == 0


async def test_a_stream_nobody_ever_served_is_unavailable_at_once(redis_url: str) -> None:
    async with client(redis_url) as c:
        started = time.monotonic()
        with pytest.raises(RpcUnavailable, match="nobody serves"):
            await c.call(CALLS, ask("hi"), Echoed, timeout_s=30)
        assert time.monotonic() - started < 5  # not the call's timeout
        r = aioredis.Redis.from_url(redis_url)
        assert not await r.exists(CALLS)  # the call did not create the stream
        await r.aclose()


async def test_no_server_running_is_a_timeout_and_the_stale_call_is_skipped_later(
    redis_url: str,
) -> None:
    calls: list[str] = []

    async def recording(req: Echo) -> Echoed:
        calls.append(req.spec)
        return echoed(req.spec)

    async with bus(redis_url, "echo-1") as b:
        await b.ensure_group(CALLS, RPC_GROUP)  # a server existed once, and is down now
    async with client(redis_url) as c:
        with pytest.raises(RpcTimeout, match="no answer to grammar_compile"):
            await c.call(CALLS, ask("stale"), Echoed, timeout_s=0.3)
        expired = served(Echo.TYPE, "expired")
        async with server(redis_url, recording):
            reply = await c.call(CALLS, ask("fresh"), Echoed, timeout_s=5)
        assert reply.key == "fresh"
        assert calls == ["fresh"]  # the stale call was dropped unanswered: its caller gave up
        assert served(Echo.TYPE, "expired") == expired + 1
    r = aioredis.Redis.from_url(redis_url)
    assert (await r.xpending(CALLS, RPC_GROUP))["pending"] == 0
    await r.aclose()


async def test_a_handler_error_is_an_error_answer_and_the_server_keeps_serving(
    redis_url: str,
) -> None:
    async def picky(req: Echo) -> Echoed:
        if req.spec == "crash":
            raise ValueError("cannot echo that")
        if req.spec == "refuse":
            raise RpcError("bad_request", "say something else")
        if req.spec == "huge":  # an answer over the codec's size limit
            return Echoed.model_construct(**echoed("x").model_dump() | {"key": "x" * 2**26})
        return echoed(req.spec)

    async with server(redis_url, picky), client(redis_url) as c:
        with pytest.raises(RpcError) as crash:
            await c.call(CALLS, ask("crash"), Echoed, timeout_s=5)
        assert crash.value.kind == "internal" and "ValueError: cannot echo that" in str(crash.value)
        with pytest.raises(RpcError) as refused:
            await c.call(CALLS, ask("refuse"), Echoed, timeout_s=5)
        assert (refused.value.kind, refused.value.message) == ("bad_request", "say something else")
        with pytest.raises(RpcError, match="the answer to grammar_compile does not encode"):
            await c.call(CALLS, ask("huge"), Echoed, timeout_s=10)
        # A call type this server does not handle, and an answer of the wrong type.
        with pytest.raises(RpcError, match="echo does not answer kv_stats calls"):
            await c.call(CALLS, KVStats(), Echoed, timeout_s=5)
        with pytest.raises(RpcError, match="expected a rpc_pong answer, got grammar_compiled"):
            await c.call(CALLS, ask("ok"), Pong, timeout_s=5)
        assert (await c.call(CALLS, ask("ok"), Echoed, timeout_s=5)).key == "ok"


async def test_garbage_on_the_request_stream_is_dead_lettered_and_serving_goes_on(
    redis_url: str,
) -> None:
    r = aioredis.Redis.from_url(redis_url)
    victim = "meshllm:rpct:requests"  # a stream a forged reply_stream would write to
    async with server(redis_url) as srv, client(redis_url) as c, bus(redis_url, "forger") as forger:
        await r.xadd(CALLS, {"m": b"\xc1 not msgpack"})
        await forger.publish(CALLS, AbortRequest(request_id="not a call"))
        forged = ask("x").model_copy(
            update={"correlation_id": "c1", "reply_stream": victim, "deadline": time.time() + 60}
        )
        await forger.publish(CALLS, forged)
        no_id = ask("x").model_copy(update={"reply_stream": REPLIES, "deadline": time.time() + 60})
        await forger.publish(CALLS, no_id)
        reply = await c.call(CALLS, ask("after"), Echoed, timeout_s=5)
    assert reply.key == "after" and srv.served == 1
    dead = await r.xrange(S.deadletter)
    reasons = [fields[b"reason"] for _, fields in dead]
    assert reasons == [b"malformed", b"bad_envelope", b"bad_envelope", b"bad_envelope"]
    details = [fields[b"detail"].decode() for _, fields in dead[1:]]
    assert "abort is not a call" in details[0]
    assert victim in details[1] and "no correlation id" in details[2]
    assert not await r.exists(victim)  # nothing was written where the forger pointed
    assert (await r.xpending(CALLS, RPC_GROUP))["pending"] == 0
    await r.aclose()


async def test_a_reply_that_never_comes_times_out_and_its_late_answer_is_dropped(
    redis_url: str,
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(req: Echo) -> Echoed:
        if req.spec == "slow":
            entered.set()
            await release.wait()
        return echoed(req.spec)

    async with server(redis_url, slow, concurrency=4), client(redis_url) as c:
        before = dropped()
        call = asyncio.create_task(c.call(CALLS, ask("slow"), Echoed, timeout_s=0.5))
        await entered.wait()
        with pytest.raises(RpcTimeout):
            await call
        release.set()  # the answer goes out now, to a call that gave up
        assert (await c.call(CALLS, ask("next"), Echoed, timeout_s=5)).key == "next"
        for _ in range(500):  # the late answer is read (and dropped) by the reply reader
            if dropped() > before:
                break
            await asyncio.sleep(0.01)
        assert dropped() == before + 1 and c.in_flight == 0


async def test_a_safe_call_is_sent_again_when_the_first_attempt_is_lost(redis_url: str) -> None:
    """A replica takes the first attempt and crashes (never answers); the retry is served."""
    async with bus(redis_url, "doomed") as doomed, client(redis_url) as c:
        await doomed.ensure_group(CALLS, RPC_GROUP)
        call = asyncio.create_task(c.call(CALLS, ask("again"), Echoed, timeout_s=4, attempts=2))
        taken: list[Any] = []
        while not taken:
            taken = await doomed.read_group(RPC_GROUP, [CALLS], count=1, block_ms=1000)
        async with server(redis_url):
            reply = await call
        assert reply.key == "again" and reply.correlation_id == taken[0].message.correlation_id


async def test_a_crashed_replicas_pending_call_is_claimed_and_answered(redis_url: str) -> None:
    async with bus(redis_url, "crashed") as crashed, client(redis_url) as c:
        await crashed.ensure_group(CALLS, RPC_GROUP)
        call = asyncio.create_task(c.call(CALLS, ask("orphan"), Echoed, timeout_s=10))
        taken: list[Any] = []
        while not taken:
            taken = await crashed.read_group(RPC_GROUP, [CALLS], count=1, block_ms=1000)
        async with server(redis_url, name="echo-2", claim_idle_ms=100):
            assert (await call).key == "orphan"


@pytest.mark.parametrize("concurrent", [False, True])
async def test_concurrency_one_serves_in_order_and_more_overlaps(
    redis_url: str, concurrent: bool
) -> None:
    log: list[str] = []
    first_entered, second_started, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def ordered(req: Echo) -> Echoed:
        log.append(f"{req.spec}+")
        if req.spec == "first":
            first_entered.set()
            # Concurrent: blocks until the second call runs (deadlocks if it cannot).
            await (second_started.wait() if concurrent else release.wait())
        else:
            second_started.set()
        log.append(f"{req.spec}-")
        return echoed(req.spec)

    r = aioredis.Redis.from_url(redis_url)
    async with (
        server(redis_url, ordered, concurrency=2 if concurrent else 1),
        client(redis_url) as c,
    ):
        first = asyncio.create_task(c.call(CALLS, ask("first"), Echoed, timeout_s=5))
        await first_entered.wait()
        second = asyncio.create_task(c.call(CALLS, ask("second"), Echoed, timeout_s=5))
        # The second call is queued behind the first (concurrency 1: both in the stream, the
        # first pending), or already served (served calls are deleted with their ack).
        while not second_started.is_set() and await r.xlen(CALLS) < 2:
            await asyncio.sleep(0.005)
        release.set()
        await asyncio.gather(first, second)
    await r.aclose()
    if concurrent:
        assert log.index("second+") < log.index("first-")
    else:
        assert log == ["first+", "first-", "second+", "second-"]


async def test_reply_streams_expire_and_are_capped(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with server(redis_url), client(redis_url) as c:
        await c.call(CALLS, ask("x"), Echoed, timeout_s=5)
        ttl = await r.ttl(REPLIES)
        assert 0 < ttl <= REPLY_TTL_S  # a caller that dies leaves nothing behind for good
    with pytest.raises(ValueError, match="is not meshllm:rpct:rpc:<service>:<instance>"):
        RpcClient(Bus(redis_url, "x"), "meshllm:rpct:replies:gw", S.rpc_reply_prefix)
    await r.aclose()
