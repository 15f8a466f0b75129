"""What an operator holding one service's real credentials still cannot do: list the keyspace,
run anything server-wide or any script, delete/trim/rewrite a stream the service only feeds,
write a stream it only reads. Each rule against a real redis-server loading the rendered ACL
(the fixtures of test_acl.py), each refused command run for real."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError

from infra.redis.render_acl import SERVICE_USERS, main
from tests.integration.test_acl import S, acl_redis, raw
from tests.support.redis_server import RedisServer

__all__ = ["acl_redis"]

SERVICES = [u.name for u in SERVICE_USERS]


def refused(client: redis.Redis, *command: str | bytes) -> None:
    with pytest.raises(NoPermissionError):
        client.execute_command(*command)


@pytest.mark.parametrize("service", SERVICES)
def test_no_user_lists_the_keyspace(acl_redis: RedisServer, service: str) -> None:
    """Key names of other services stay hidden. The kvstore alone may SCAN (its recovery
    lists the metadata keys; SCAN takes no key, so no pattern could confine it)."""
    client = raw(acl_redis, service)
    for command in (("KEYS", "*"), ("RANDOMKEY",), ("DBSIZE",), ("INFO", "keyspace")):
        refused(client, *command)
    if service == "kvstore":
        assert client.execute_command("SCAN", "0", "MATCH", "meshllm:*:kvmeta:*")[0] == 0
    else:
        refused(client, "SCAN", "0")


@pytest.mark.parametrize("service", SERVICES)
def test_no_user_runs_server_wide_commands(acl_redis: RedisServer, service: str) -> None:
    client = raw(acl_redis, service)
    for command in (
        ("FLUSHALL",), ("FLUSHDB",), ("FUNCTION", "FLUSH"), ("FUNCTION", "LIST"),
        ("FUNCTION", "DELETE", "lib"), ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"),
        ("CONFIG", "GET", "*"), ("CONFIG", "SET", "maxmemory", "1"),
        ("SAVE",), ("BGSAVE",), ("SWAPDB", "0", "1"), ("CLIENT", "LIST"),
        ("CLIENT", "KILL", "TYPE", "normal"), ("ACL", "LIST"), ("ACL", "SETUSER", service, "+@all"),
        ("SLOWLOG", "GET"), ("MEMORY", "STATS"), ("SHUTDOWN", "NOSAVE"),
    ):  # fmt: skip
        refused(client, *command)
    assert client.ping()  # the server is still up (SHUTDOWN was refused)


@pytest.mark.parametrize("service", SERVICES)
def test_no_user_runs_scripts(acl_redis: RedisServer, service: str) -> None:
    """No service uses EVAL or FCALL, so none may (a script runs any command it likes on the
    keys it names)."""
    client = raw(acl_redis, service)
    library = "#!lua name=lib\nredis.register_function('f', function() return 1 end)"
    for command in (
        ("EVAL", "return 1", "0"), ("EVAL_RO", "return 1", "0"),
        ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"),
        ("SCRIPT", "LOAD", "return 1"), ("FUNCTION", "LOAD", library), ("FCALL", "f", "0"),
    ):  # fmt: skip
        refused(client, *command)


# (service, a stream it only appends to): it may XADD there and nothing else.
FEEDS = [
    ("gateway", S.requests),
    ("gateway", S.aborts),
    ("gateway", S.calls("grammar")),
    *((name, S.heartbeats) for name in SERVICES),
    *((name, S.deadletter) for name in SERVICES),
    ("scheduler", S.steps("0")),
    ("scheduler", S.replies("gw-1")),
    ("scheduler", S.calls("kvstore")),
    ("worker", S.results("0")),
    ("worker", S.control("0")),
    ("grammar", S.rpc_replies("gateway", "gw-1")),
    ("kvstore", S.rpc_replies("scheduler", "s-1")),
]


@pytest.mark.parametrize(("service", "stream"), FEEDS, ids=[f"{s}->{k}" for s, k in FEEDS])
def test_appenders_cannot_delete_trim_or_rewrite(
    acl_redis: RedisServer, service: str, stream: str
) -> None:
    client = raw(acl_redis, service)
    entry = client.xadd(stream, {"m": b"x"})
    for command in (
        ("DEL", stream), ("UNLINK", stream), ("XTRIM", stream, "MAXLEN", "0"),
        ("XDEL", stream, entry), ("SET", stream, "x"), ("RENAME", stream, f"{stream}:x"),
        ("XSETID", stream, "9999999999999-0"), ("XGROUP", "DESTROY", stream, "g"),
        ("COPY", stream, f"{stream}:x"), ("RESTORE", stream, "0", "x", "REPLACE"),
        ("PERSIST", stream), ("PEXPIRE", stream, "1"),
    ):  # fmt: skip
        refused(client, *command)
    if ":replies:" in stream or ":rpc:" in stream:
        assert client.expire(stream, 60)  # a reply's writer renews its stream's expiry
    else:
        refused(client, "EXPIRE", stream, "60")
    assert client.xadd(stream, {"m": b"y"}) > entry  # still appends


# (feeder, consumer, a stream the consumer reads through its group)
CONSUMED = [
    ("gateway", "scheduler", S.requests),
    ("gateway", "scheduler", S.group_requests("0")),
    ("gateway", "grammar", S.calls("grammar")),
    ("scheduler", "kvstore", S.calls("kvstore")),
]


@pytest.mark.parametrize(
    ("feeder", "consumer", "stream"), CONSUMED, ids=[f"{c}<-{s}" for _, c, s in CONSUMED]
)
def test_consumers_delete_what_they_acked_and_nothing_more(
    acl_redis: RedisServer, feeder: str, consumer: str, stream: str
) -> None:
    """A consumer keeps the stream it reads short by deleting the entries it acked (shared.bus);
    it cannot drop the stream or trim what is not read yet."""
    entry = raw(acl_redis, feeder).xadd(stream, {"m": b"x"})
    client = raw(acl_redis, consumer)
    client.xgroup_create(stream, "g", id="0")
    assert client.xreadgroup("g", "c", {stream: ">"})
    assert client.xack(stream, "g", entry) == 1
    assert client.xdel(stream, entry) == 1
    for command in (("DEL", stream), ("UNLINK", stream), ("XTRIM", stream, "MAXLEN", "0")):
        refused(client, *command)


def test_gateway_writes_no_reply_stream(acl_redis: RedisServer) -> None:
    """Schedulers write a gateway's replies, the grammar service its call answers; a gateway
    writes neither, its own or another gateway's, and beats only by XADD."""
    gateway = raw(acl_redis, "gateway")
    for stream in (S.replies("gw-1"), S.replies("gw-2"), S.rpc_replies("gateway", "gw-2")):
        refused(gateway, "XADD", stream, "*", "m", "x")
    refused(gateway, "XDEL", S.heartbeats, "1-0")


def test_scheduler_only_reads_its_workers_streams(acl_redis: RedisServer) -> None:
    """Results and worker announcements come from the worker: a scheduler reads them, never
    writes them (it could forge a step's tokens)."""
    scheduler, worker = raw(acl_redis, "scheduler"), raw(acl_redis, "worker")
    for stream in (S.results("0"), S.control("0")):
        worker.xadd(stream, {"m": b"x"})
        refused(scheduler, "XADD", stream, "*", "m", "x")
        assert scheduler.xread({stream: "0"}, count=1)
    refused(worker, "XADD", S.steps("0"), "*", "m", "x")  # and the reverse


def test_rendered_file_is_owner_only(tmp_path: Path) -> None:
    """It holds password hashes: mode 0600, also over a file that was world-readable."""
    out = tmp_path / "users.acl"
    out.write_text("old")
    out.chmod(0o644)
    assert main(["--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert out.read_text().startswith("user default off")
    fresh = tmp_path / "sub" / "fresh.acl"
    assert main(["--out", str(fresh)]) == 0
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
