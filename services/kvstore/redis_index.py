"""The kvstore's Redis side: chunk metadata, eviction deletes, recovery after a restart.

The kvstore never writes a payload (its ACL allows only DEL/UNLINK on `meshllm:*:kv:*`); it
writes one metadata hash per ready chunk, `meshllm:<cluster>:kvmeta:...` beside the payload
key, with the chunk's size, end position and a store sequence number. Metadata exists only for
chunks whose write completed, so it is what a restarted kvstore rebuilds its table from.

Eviction deletes the payload AND its metadata in one MULTI/EXEC: a reader never sees metadata
that promises a payload that is gone, and a restart never resurrects an evicted chunk. (On a
Redis Cluster the two keys would need one hash tag to share a slot; one Redis today.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.kv.offload_key import meta_key_of_payload, meta_prefix, payload_key_of_meta

SCAN_COUNT = 1000


@dataclass(frozen=True, slots=True)
class StoredChunk:
    payload_key: str
    nbytes: int
    end: int
    seq: int


class RedisOffloadIndex:
    def __init__(self, redis: aioredis.Redis, cluster: str) -> None:
        self.redis = redis
        self.cluster = cluster

    async def write_meta(self, chunks: Sequence[StoredChunk]) -> None:
        if not chunks:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for c in chunks:
                pipe.hset(
                    meta_key_of_payload(c.payload_key),
                    mapping={"nbytes": c.nbytes, "end": c.end, "seq": c.seq},
                )
            await pipe.execute()

    async def delete(self, payload_keys: Sequence[str]) -> None:
        """Delete payloads and their metadata together (one transaction)."""
        if not payload_keys:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            for key in payload_keys:
                # One UNLINK per key: the ACL grants payload deletes through a selector and
                # metadata through the root rules, and Redis checks a multi-key command against
                # one of them at a time, so a combined UNLINK would be refused.
                pipe.unlink(key)
                pipe.unlink(meta_key_of_payload(key))
            await pipe.execute()

    async def delete_payloads(self, payload_keys: Sequence[str]) -> None:
        """Drop partial payloads of failed writes (they have no metadata yet)."""
        if payload_keys:
            await self.redis.unlink(*payload_keys)

    async def scan_meta(self) -> list[StoredChunk]:
        """Every chunk with metadata whose payload still exists, oldest store first. Metadata
        without a payload (deleted behind the kvstore's back) is removed."""
        meta_keys = [
            k.decode() if isinstance(k, bytes) else k
            async for k in self.redis.scan_iter(
                match=meta_prefix(self.cluster) + "*", count=SCAN_COUNT
            )
        ]
        chunks: list[StoredChunk] = []
        dangling: list[str] = []
        for begin in range(0, len(meta_keys), SCAN_COUNT):
            part = meta_keys[begin : begin + SCAN_COUNT]
            async with self.redis.pipeline(transaction=False) as pipe:
                for meta in part:
                    pipe.hgetall(meta)
                    pipe.exists(payload_key_of_meta(meta))
                replies = await pipe.execute()
            for i, meta in enumerate(part):
                fields, exists = replies[2 * i], replies[2 * i + 1]
                parsed = _parse_meta(payload_key_of_meta(meta), fields)
                if parsed is None or not exists:
                    dangling.append(meta)
                else:
                    chunks.append(parsed)
        if dangling:
            await self.redis.unlink(*dangling)
        # Oldest store first; within one store, tail first so the head is restored most recent.
        chunks.sort(key=lambda c: (c.seq, -c.end))
        return chunks


def _parse_meta(payload_key: str, fields: dict[bytes, bytes]) -> StoredChunk | None:
    try:
        return StoredChunk(
            payload_key, int(fields[b"nbytes"]), int(fields[b"end"]), int(fields[b"seq"])
        )
    except (KeyError, ValueError):
        return None


def store_seq() -> int:
    """A store sequence number: increasing across kvstore restarts (wall clock, ns)."""
    return time.time_ns()
