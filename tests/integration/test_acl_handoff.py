"""The rendered Redis ACL lets schedulers run the P/D handoff (prefill publishes on `handoff`,
decode reads, acks and claims through the `decoders` group) and keeps other services off it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import NoPermissionError

from infra.redis.render_acl import redis_url, render_acl
from shared.bus import Bus
from shared.protocol import SubmitRequest
from shared.streams import DECODE_GROUP, Streams
from tests.support.redis_server import RedisServer

S = Streams("acl-pd")


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    acl = tmp_path_factory.mktemp("acl-pd") / "users.acl"
    acl.write_text(render_acl({}))
    server = RedisServer(extra_args=["--aclfile", str(acl)]).start()
    yield server
    server.stop()


async def test_schedulers_hand_off_and_others_cannot(acl_redis: RedisServer) -> None:
    url = redis_url("scheduler", "127.0.0.1", acl_redis.port, {})
    prefill, decode = Bus(url, "prefill-1"), Bus(url, "decode-1")
    for bus in (prefill, decode):
        await bus.connect()
    try:
        await decode.ensure_group(S.handoff, DECODE_GROUP)
        submit = SubmitRequest(request_id="r", prompt_token_ids=[1, 2], reply_stream="x")
        await prefill.publish(S.handoff, submit)
        got = await decode.read_group(DECODE_GROUP, [S.handoff], block_ms=1000)
        assert [d.message for d in got] == [submit]
        claimed = await decode.claim_idle(S.handoff, DECODE_GROUP, 0)
        assert [(d.entry_id, d.message) for d in claimed] == [(d.entry_id, d.message) for d in got]
        await decode.ack(DECODE_GROUP, got)
    finally:
        for bus in (prefill, decode):
            await bus.close()
    for service in ("gateway", "worker"):
        other = redis.Redis.from_url(redis_url(service, "127.0.0.1", acl_redis.port, {}))
        with pytest.raises(NoPermissionError):
            other.xadd(S.handoff, {"m": b"x"})
        other.close()
