"""The ACL for KV-aware routing: the gateway routes to a group's own requests stream and reads
the groups' KV events; schedulers read any group's requests stream (their own, and a dead
group's) and write KV events, which the gateway cannot."""

from __future__ import annotations

import pytest
from redis.exceptions import NoPermissionError

from shared.bus import Bus
from shared.protocol import KVEvents, SubmitRequest
from shared.streams import SCHEDULER_GROUP
from tests.integration.test_acl import S, acl_redis, bus_as, raw  # noqa: F401 - fixtures
from tests.support.redis_server import RedisServer


async def test_routed_requests_and_kv_events_pass_the_acl(bus_as: dict[str, Bus]) -> None:  # noqa: F811
    gw, sched = bus_as["gateway"], bus_as["scheduler"]
    for group in ("1", "7"):  # its own group and another's (adopted when that one is dead)
        stream = S.group_requests(group)
        await sched.ensure_group(stream, SCHEDULER_GROUP)
        submit = SubmitRequest(
            request_id=f"r{group}", prompt_token_ids=[1], reply_stream=S.replies("gw")
        )
        await gw.publish(stream, submit)
        got = await sched.read_group(SCHEDULER_GROUP, [stream], block_ms=1000)
        assert [d.message for d in got] == [submit]
        assert await sched.claim_idle(stream, SCHEDULER_GROUP, 0)
        await sched.ack(SCHEDULER_GROUP, got)
    event = KVEvents(group="1", scheduler_id="s", incarnation="x", block_size=16, stored=b"1" * 16)
    await sched.publish(S.kv_events, event)
    assert [d.message for d in await gw.read({S.kv_events: "0"}, block_ms=100)] == [event]


def test_only_schedulers_write_kv_events(acl_redis: RedisServer) -> None:  # noqa: F811
    for name in ("gateway", "worker", "kvstore", "grammar"):
        with pytest.raises(NoPermissionError):
            raw(acl_redis, name).xadd(S.kv_events, {"m": b"x"})
    with pytest.raises(NoPermissionError):
        raw(acl_redis, "scheduler").xrange(S.kv_events)  # write-only for it
    with pytest.raises(NoPermissionError):
        raw(acl_redis, "gateway").xrange(S.group_requests("1"))
