"""The kvstore's Redis work under the rendered ACL, as the `kvstore` user: metadata writes,
eviction deletes (payload through the DEL/UNLINK-only selector), recovery scans."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from infra.redis.render_acl import redis_url, render_acl
from services.kvstore.redis_index import RedisOffloadIndex, StoredChunk
from shared.kv.offload_key import KeySpace
from tests.support.redis_server import RedisServer
from tests.unit.kvstore.prefix import prefix_keys

SPACE = KeySpace("acl", "m", 1)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    acl: Path = tmp_path_factory.mktemp("kvacl") / "users.acl"
    acl.write_text(render_acl({}))
    server = RedisServer(extra_args=["--aclfile", str(acl)]).start()
    yield server
    server.stop()


async def test_kvstore_user_can_do_all_its_redis_work(acl_redis: RedisServer) -> None:
    worker = aioredis.Redis.from_url(redis_url("worker", "127.0.0.1", acl_redis.port, {}))
    kv = aioredis.Redis.from_url(redis_url("kvstore", "127.0.0.1", acl_redis.port, {}))
    index = RedisOffloadIndex(kv, "acl")
    keys = prefix_keys(3)
    payloads = [SPACE.payload_key(k) for k in keys]
    for name in payloads:
        await worker.set(name, b"\0" * 8)
    await index.write_meta([StoredChunk(p, 8, 16 * (i + 1), 1) for i, p in enumerate(payloads)])
    assert [c.payload_key for c in await index.scan_meta()] == payloads[::-1]  # tail first
    await index.delete(payloads[:1])
    assert await kv.exists(payloads[0]) == 0 and await kv.exists(SPACE.meta_key(keys[0])) == 0
    await index.delete_payloads(payloads[1:])  # failed writes: payloads only
    assert await kv.exists(*payloads) == 0
    assert await index.scan_meta() == []  # dangling metadata found and removed
    assert await kv.exists(SPACE.meta_key(keys[1]), SPACE.meta_key(keys[2])) == 0
    await worker.aclose()
    await kv.aclose()
