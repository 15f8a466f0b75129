"""The fault handling's Redis operations pass the rendered ACL: the gateway keeping its reply
stream alive, the scheduler's delivery counts, dead letters of decoded entries, and its
NOMKSTREAM note to a gateway that may be gone."""

from __future__ import annotations

from shared.bus import Bus
from shared.protocol import RequestDelta, SubmitRequest, TokenDelta
from tests.integration.test_acl import S, acl_redis, bus_as, login
from tests.support.redis_server import RedisServer

__all__ = ["acl_redis", "bus_as"]


async def test_gateway_keeps_its_reply_stream_alive(bus_as: dict[str, Bus]) -> None:
    from services.gateway.stream.bus_client import GatewayBusClient

    client = GatewayBusClient(bus_as["gateway"], S, "gw-ttl", max_pending=1, reply_stream_ttl_s=30)
    await client.refresh_reply_stream()  # creates it empty, with its TTL
    await client.refresh_reply_stream()  # refreshes it
    assert 0 < await bus_as["gateway"].redis.ttl(client.reply_stream) <= 30


async def test_scheduler_counts_deliveries_and_dead_letters_decoded_entries(
    acl_redis: RedisServer, bus_as: dict[str, Bus]
) -> None:
    gw, sched = bus_as["gateway"], bus_as["scheduler"]
    await sched.ensure_group(S.requests, "faults", start_id="$")
    reply = S.replies("gw-acl")
    submit = SubmitRequest(request_id="poison", prompt_token_ids=[1], reply_stream=reply)
    await gw.publish(S.requests, submit)
    first = await sched.read_group("faults", [S.requests], block_ms=1000)
    again = await sched.read_group("faults", [S.requests], own_pending=True)
    assert [d.deliveries for d in again] == [2]
    assert [d.deliveries for d in await sched.claim_idle(S.requests, "faults", 0)] == [3]
    await sched.redis.xclaim(
        S.requests, "faults", sched.consumer, 0, [first[0].entry_id], justid=True
    )
    await sched.dead_letter("faults", [(again[0], "max_deliveries", "delivered 3 times")])
    assert await sched.read_group("faults", [S.requests], own_pending=True) == []

    admin = login(acl_redis.port, "admin", "admin-pw")
    (_, record), *_ = admin.xrevrange(S.deadletter, count=1)
    assert record[b"reason"] == b"max_deliveries"

    note = TokenDelta(scheduler_id="s", deltas=[RequestDelta(request_id="poison", start_index=0)])
    assert await sched.publish_if_exists(S.replies("gone"), note) is None
