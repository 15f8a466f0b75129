"""The rendered Redis ACL: each service user can do its own bus operations and nothing else.

A real redis-server runs with the ACL file of infra/redis/render_acl.py; the operations go
through the real Bus (the same calls the services make), so a permission a service needs but
the ACL lacks fails here, not in production.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.retry import Retry

from infra.redis.render_acl import SERVICE_USERS, redis_url, render_acl
from shared.bus import Bus
from shared.protocol import (
    AbortRequest,
    Heartbeat,
    Ping,
    Pong,
    RequestDelta,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenDelta,
    WorkerReady,
)
from shared.rpc import RpcClient, RpcServer
from shared.streams import SCHEDULER_GROUP, Streams
from tests.support.redis_server import RedisServer

S = Streams("acl")
ENV = {  # the other services use their dev defaults
    "MESHLLM_REDIS_PASSWORD_WORKER": "custom-worker-pw",
    "MESHLLM_REDIS_PASSWORD_ADMIN": "admin-pw",
}


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    acl = tmp_path_factory.mktemp("acl") / "users.acl"
    acl.write_text(render_acl(ENV))
    server = RedisServer(extra_args=["--aclfile", str(acl)]).start()
    yield server
    server.stop()


def url(server: RedisServer, service: str) -> str:
    return redis_url(service, "127.0.0.1", server.port, ENV)


@pytest.fixture
async def bus_as(acl_redis: RedisServer) -> AsyncIterator[dict[str, Bus]]:
    """One connected Bus per service user, each with the dead-letter stream set."""
    buses = {
        u.name: Bus(url(acl_redis, u.name), f"{u.name}-1", dead_letter_stream=S.deadletter)
        for u in SERVICE_USERS
    }
    for bus in buses.values():
        await bus.connect()
    yield buses
    for bus in buses.values():
        await bus.close()


NO_RETRY = Retry(NoBackoff(), 0)  # a refused login is final; redis-py would retry it 3 times


def raw(server: RedisServer, service: str) -> redis.Redis:
    return redis.Redis.from_url(url(server, service), retry=NO_RETRY)


def login(port: int, username: str | None, password: str | None) -> redis.Redis:
    return redis.Redis(port=port, username=username, password=password, retry=NO_RETRY)


# --- who cannot get in --------------------------------------------------------------------


def test_default_user_is_disabled(acl_redis: RedisServer) -> None:
    with pytest.raises(AuthenticationError):
        login(acl_redis.port, None, None).ping()
    with pytest.raises(AuthenticationError):
        login(acl_redis.port, "default", "").ping()


def test_passwords_come_from_env_and_the_file_holds_only_hashes(acl_redis: RedisServer) -> None:
    with pytest.raises(AuthenticationError):
        login(acl_redis.port, "worker", "meshllm-dev-worker").ping()
    assert raw(acl_redis, "worker").ping()
    text = render_acl(ENV)
    assert "custom-worker-pw" not in text and "meshllm-dev-gateway" not in text
    assert "admin-pw" not in text and "user admin" in text
    assert "user admin" not in render_acl({})  # no admin without an explicit password


# --- what the worker must not touch ---------------------------------------------------------


def test_worker_is_refused_other_services_keys(acl_redis: RedisServer) -> None:
    gateway, worker = raw(acl_redis, "gateway"), raw(acl_redis, "worker")
    grammar = raw(acl_redis, "grammar")
    gateway.xadd(S.replies("gw-1"), {"m": b"x"})
    grammar.set("meshllm:acl:grammar:abc", b"compiled")
    with pytest.raises(NoPermissionError):
        worker.xrange(S.replies("gw-1"))  # gateway-only stream
    with pytest.raises(NoPermissionError):
        worker.get("meshllm:acl:grammar:abc")  # grammar cache
    with pytest.raises(NoPermissionError):
        worker.xadd(S.requests, {"m": b"x"})  # only the gateway submits
    with pytest.raises(NoPermissionError):
        worker.set("meshllm:acl:kvmeta:1", b"x")  # the kvstore's metadata
    with pytest.raises(NoPermissionError):
        worker.xrange(S.heartbeats)  # heartbeats are write-only for it
    with pytest.raises(NoPermissionError):
        worker.flushall()
    with pytest.raises(NoPermissionError):
        worker.keys("*")
    with pytest.raises(NoPermissionError):
        worker.config_get("requirepass")


def test_kvstore_deletes_payloads_but_never_writes_them(acl_redis: RedisServer) -> None:
    worker, kvstore = raw(acl_redis, "worker"), raw(acl_redis, "kvstore")
    worker.set("meshllm:acl:kv:block1", b"\x00" * 64)
    assert kvstore.strlen("meshllm:acl:kv:block1") == 64
    with pytest.raises(NoPermissionError):
        kvstore.set("meshllm:acl:kv:block1", b"overwritten")
    with pytest.raises(NoPermissionError):
        kvstore.append("meshllm:acl:kv:block1", b"more")
    assert kvstore.delete("meshllm:acl:kv:block1") == 1
    kvstore.hset("meshllm:acl:kvmeta:block1", mapping={"ref": 0})
    with pytest.raises(NoPermissionError):
        kvstore.delete("meshllm:acl:grammar:abc")


def test_gateway_cannot_read_requests_or_write_grammars(acl_redis: RedisServer) -> None:
    gateway = raw(acl_redis, "gateway")
    gateway.xadd(S.requests, {"m": b"x"})
    with pytest.raises(NoPermissionError):
        gateway.xrange(S.requests)
    with pytest.raises(NoPermissionError):
        gateway.set("meshllm:acl:grammar:abc", b"poison")


# --- what each service must be able to do -----------------------------------------------------


async def test_each_service_runs_its_own_bus_operations(bus_as: dict[str, Bus]) -> None:
    gw, sched, worker = bus_as["gateway"], bus_as["scheduler"], bus_as["worker"]
    reply_stream = S.replies("gw-1")

    # every service: heartbeats
    for name, bus in bus_as.items():
        await bus.publish(S.heartbeats, Heartbeat(service=name, instance_id="i", incarnation="x"))

    # gateway -> scheduler: submit and abort; the scheduler reads through its group, acks, claims
    await sched.ensure_group(S.requests, SCHEDULER_GROUP)
    submit = SubmitRequest(request_id="r1", prompt_token_ids=[1, 2], reply_stream=reply_stream)
    await gw.publish(S.requests, submit)
    got = await sched.read_group(SCHEDULER_GROUP, [S.requests], block_ms=1000)
    assert [d.message for d in got] == [submit]
    claimed = await bus_as["scheduler"].claim_idle(S.requests, SCHEDULER_GROUP, 0)
    assert [(d.entry_id, d.message) for d in claimed] == [(d.entry_id, d.message) for d in got]
    await sched.ack(SCHEDULER_GROUP, got)
    aborts_seen = {S.aborts: "0"}
    await gw.publish(S.aborts, AbortRequest(request_id="r1"))
    assert [d.message.request_id for d in await sched.read(aborts_seen, block_ms=100)] == ["r1"]

    # scheduler <-> worker: steps, results, control
    await worker.ensure_group(S.steps("0"), "workers")
    await sched.ensure_group(S.results("0"), "schedulers")
    await sched.ensure_group(S.control("0"), "schedulers")
    await sched.publish(S.steps("0"), StepPlan(step_id=1, scheduler_id="s"))
    steps = await worker.read_group("workers", [S.steps("0")], block_ms=1000)
    assert [d.message.step_id for d in steps] == [1]
    await worker.ack("workers", steps)
    ready = WorkerReady(
        worker_id="w", incarnation="x", model="m", num_kv_blocks=8, block_size=16,
        vocab_size=100, max_model_len=64,
    )  # fmt: skip
    await worker.publish_many(
        [(S.results("0"), StepResult(step_id=1, worker_id="w")), (S.control("0"), ready)]
    )
    back = await sched.read_group("schedulers", [S.results("0"), S.control("0")], block_ms=1000)
    assert sorted(type(d.message).__name__ for d in back) == ["StepResult", "WorkerReady"]
    await sched.ack("schedulers", back)

    # scheduler -> gateway: token deltas on the gateway's own reply stream
    delta = TokenDelta(scheduler_id="s", deltas=[RequestDelta(request_id="r1", start_index=0)])
    replies_seen = {reply_stream: "0"}
    await sched.publish(reply_stream, delta)
    assert [d.message for d in await gw.read(replies_seen, block_ms=100)] == [delta]

    # the scheduler watches heartbeats (worker restarts), the gateway too (ready worker groups)
    for bus in (sched, gw):
        beats = await bus.read({S.heartbeats: "0"}, block_ms=100)
        assert {d.message.service for d in beats} == {u.name for u in SERVICE_USERS}


async def test_key_operations_of_each_service(bus_as: dict[str, Bus]) -> None:
    grammar, gw, sched = bus_as["grammar"].redis, bus_as["gateway"].redis, bus_as["scheduler"].redis
    worker, kvstore = bus_as["worker"].redis, bus_as["kvstore"].redis
    await grammar.set("meshllm:acl:grammar:k1", b"compiled")
    assert await gw.get("meshllm:acl:grammar:k1") == b"compiled"
    assert await sched.get("meshllm:acl:grammar:k1") == b"compiled"
    await worker.set("meshllm:acl:kv:b1", b"payload", ex=60)
    assert await worker.get("meshllm:acl:kv:b1") == b"payload"
    await sched.hset("meshllm:acl:kvmeta:b1", mapping={"pos": 16})
    assert await kvstore.hget("meshllm:acl:kvmeta:b1", "pos") == b"16"
    assert await kvstore.unlink("meshllm:acl:kv:b1") == 1
    for name, bus in bus_as.items():  # everyone writes its own state key and nobody else's
        await bus.redis.set(S.state_key(name, "i"), b"{}", ex=60)
    with pytest.raises(NoPermissionError):
        await worker.set(S.state_key("scheduler", "i"), b"{}")
    assert await sched.info("server")


async def test_bad_entries_reach_the_dead_letter_stream(
    acl_redis: RedisServer, bus_as: dict[str, Bus]
) -> None:
    """The bus moves an undecodable entry aside with the consumer's own permissions."""
    sched = bus_as["scheduler"]
    await sched.ensure_group(S.requests, "dl-test", start_id="$")
    gateway = aioredis.Redis.from_url(url(acl_redis, "gateway"))
    await gateway.xadd(S.requests, {"m": b"\xc1 not msgpack"})
    await gateway.aclose()
    assert await sched.read_group("dl-test", [S.requests], block_ms=1000) == []
    with pytest.raises(NoPermissionError):
        raw(acl_redis, "scheduler").xrange(S.deadletter)  # write-only for services
    admin = login(acl_redis.port, "admin", "admin-pw")
    (_, record), *_ = admin.xrevrange(S.deadletter, count=1)
    assert record[b"reason"] == b"malformed"
    assert record[b"consumer"] == b"scheduler-1"


def test_acl_file_loads_in_a_fresh_server(tmp_path: Path) -> None:
    """A redis-server refuses to start on any ACL error, so starting is the syntax check."""
    acl = tmp_path / "users.acl"
    acl.write_text(render_acl({"MESHLLM_REDIS_PASSWORD_ADMIN": "root-pw"}))
    server = RedisServer(extra_args=["--aclfile", str(acl)]).start()
    try:
        admin = login(server.port, "admin", "root-pw")
        users = set(admin.acl_users())
        assert users == {"default", "healthcheck", "admin"} | {u.name for u in SERVICE_USERS}
        assert admin.acl_getuser("default")["enabled"] is False
        with pytest.raises(AuthenticationError):
            login(server.port, "healthcheck", "wrong").ping()
        health = login(server.port, "healthcheck", "meshllm-dev-healthcheck")
        assert health.ping()
        with pytest.raises(ResponseError):
            health.get("anything")
    finally:
        server.stop()


# --- calls between services (shared.rpc) -------------------------------------------------------


def test_calls_are_least_privilege(acl_redis: RedisServer) -> None:
    """Each caller appends only to the calls streams of the services it calls and reads only
    its own service's reply streams; each callee writes only its callers' reply streams."""
    gateway, scheduler = raw(acl_redis, "gateway"), raw(acl_redis, "scheduler")
    grammar, kvstore, worker = (raw(acl_redis, n) for n in ("grammar", "kvstore", "worker"))
    refused = [
        (gateway.xadd, S.calls("kvstore")),  # the gateway never calls the kvstore
        (gateway.xadd, S.rpc_replies("gateway", "gw-1")),  # replies come from servers only
        (scheduler.xadd, S.calls("grammar")),
        (worker.xadd, S.calls("kvstore")),
        (worker.xadd, S.calls("grammar")),
        (grammar.xadd, S.rpc_replies("scheduler", "s-1")),  # answers only its callers
        (grammar.xadd, S.calls("kvstore")),
        (kvstore.xadd, S.rpc_replies("gateway", "gw-1")),
    ]
    for xadd, stream in refused:
        with pytest.raises(NoPermissionError):
            xadd(stream, {"m": b"x"})
    grammar.xadd(S.rpc_replies("gateway", "gw-1"), {"m": b"x"})
    kvstore.xadd(S.rpc_replies("scheduler", "s-1"), {"m": b"x"})
    for client, stream in [
        (gateway, S.rpc_replies("scheduler", "s-1")),  # another service's answers
        (scheduler, S.rpc_replies("gateway", "gw-1")),
        (kvstore, S.rpc_replies("scheduler", "s-1")),  # write-only for the callee
        (gateway, S.calls("grammar")),  # callers cannot read other callers' calls
        (worker, S.calls("kvstore")),
    ]:
        with pytest.raises(NoPermissionError):
            client.xrange(stream)


async def test_each_caller_reaches_its_callee_through_the_acl(bus_as: dict[str, Bus]) -> None:
    """The real rpc client and server as the ACL users: gateway -> grammar, scheduler ->
    kvstore, round trips and the server's dead-letter path; a forged reply stream pointing at a
    stream of the wrong caller is never written."""
    servers, clients, stop = [], [], asyncio.Event()
    for callee, caller in (("grammar", "gateway"), ("kvstore", "scheduler")):
        server = RpcServer(
            bus_as[callee],
            S.calls(callee),
            {},
            service=callee,
            instance_id=f"{callee}-1",
            reply_prefix=S.rpc_reply_prefix,
        )
        await server.start()
        servers.append(asyncio.create_task(server.run(stop)))
        client = RpcClient(bus_as[caller], S.rpc_replies(caller, f"{caller}-1"), S.rpc_reply_prefix)
        await client.start()
        clients.append(client)
        pong = await client.call(S.calls(callee), Ping(), Pong, timeout_s=5)
        assert pong.service == callee
    # The scheduler asks the kvstore to answer on a gateway's reply stream: refused by Redis.
    forged = Ping(
        correlation_id="c", reply_stream=S.rpc_replies("gateway", "gw-9"), deadline=time.time() + 2
    )
    await bus_as["scheduler"].publish(S.calls("kvstore"), forged)
    await bus_as["scheduler"].publish(S.calls("kvstore"), AbortRequest(request_id="not a call"))
    pong = await clients[1].call(S.calls("kvstore"), Ping(), Pong, timeout_s=5)  # still serving
    stop.set()
    await asyncio.gather(*servers)
    for client in clients:
        await client.stop()
    port = bus_as["gateway"].redis.connection_pool.connection_kwargs["port"]
    admin = login(port, "admin", "admin-pw")
    assert not admin.exists(S.rpc_replies("gateway", "gw-9"))
    (_, record), *_ = admin.xrevrange(S.deadletter, count=1)
    assert record[b"reason"] == b"bad_envelope" and record[b"consumer"] == b"kvstore-1"
