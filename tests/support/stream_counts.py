"""How many entries a stream was ever given: XINFO STREAM's `entries-added` (0 for a stream
that does not exist). Consumers delete what they ack (shared.bus), so XLEN says what is still
unread or pending, not what was queued; a test that asks "was this queued?" counts additions."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError


def _no_stream(exc: ResponseError) -> bool:
    return "no such key" in str(exc)


def entries_added(client: redis.Redis, stream: str) -> int:
    try:
        return int(client.xinfo_stream(stream)["entries-added"])
    except ResponseError as exc:
        if _no_stream(exc):
            return 0
        raise


async def entries_added_async(client: aioredis.Redis, stream: str) -> int:
    try:
        return int((await client.xinfo_stream(stream))["entries-added"])
    except ResponseError as exc:
        if _no_stream(exc):
            return 0
        raise
