"""The Redis-streams bus: publish messages, consume them through groups or fan-out reads.

Every entry is one field `m` holding `shared.codec.encode(msg)`. Consumers get decoded
`Delivery`s in stream order; an entry that does not decode never reaches them: it is copied to
the dead-letter stream with its reason, counted, logged, acknowledged, and reading goes on.

Delivery is at least once. A retried publish whose first attempt did reach Redis before the
connection broke adds the entry twice, and an unacknowledged entry is delivered again (own
pending entries, or claimed by another consumer); handlers are idempotent by request/step id.

Every operation survives a Redis restart: a lost connection is retried with exponential backoff
(50 ms doubling to 2 s, jittered). Reads retry for as long as it takes (a consumer has nothing
better to do); writes give up with `BusUnavailable` after `publish_timeout_s`. Redis runs
without persistence, so a restart also loses the consumer groups: the bus remembers the groups it
ensured and recreates them when Redis answers NOGROUP.

Blocking reads go through a second client without a socket timeout, each bounded instead by
`asyncio.timeout(block + op_timeout_s)`: a read that outlives its BLOCK by that much is on a dead
connection, is dropped, and retried. Everything else uses `redis` with `op_timeout_s` socket
timeouts. redis-py's own retries are off: one retry policy, in `shared.bus_retry`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from shared.bus_entry import DEAD_LETTERS, FIELD, Delivery, Rejected, decode_entry
from shared.bus_retry import BusUnavailable, retry
from shared.codec import encode
from shared.protocol import Message

__all__ = ["DEAD_LETTERS", "Bus", "BusUnavailable", "Delivery"]

log = logging.getLogger(__name__)

# Raw XREAD/XREADGROUP/XAUTOCLAIM entries: [(entry_id, {field: value}), ...] per stream.
RawEntries = Sequence[tuple[bytes | None, dict[bytes, bytes] | None]]


class Bus:
    def __init__(
        self,
        redis_url: str,
        consumer: str,
        *,
        maxlen: int = 100_000,
        dead_letter_stream: str | None = None,
        publish_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        op_timeout_s: float = 5.0,
    ) -> None:
        """`consumer` names this process in consumer groups; keep it stable across restarts so
        `read_group(own_pending=True)` finds what it read before. Without `dead_letter_stream`,
        bad entries are only logged and counted."""
        self.consumer = consumer
        self.maxlen = maxlen
        self.dead_letter_stream = dead_letter_stream
        self.publish_timeout_s = publish_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.op_timeout_s = op_timeout_s
        common: dict[str, Any] = {
            "decode_responses": False,
            "socket_connect_timeout": op_timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        self.redis: Redis = Redis.from_url(redis_url, socket_timeout=op_timeout_s, **common)
        self._reader: Redis = Redis.from_url(redis_url, socket_timeout=None, **common)
        self._groups: dict[tuple[str, str], str] = {}  # (stream, group) -> start id

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> None:
        """Wait for Redis to answer a PING (it may still be starting); BusUnavailable if not."""
        await retry("connect", self.redis.ping, self.connect_timeout_s)

    async def close(self) -> None:
        await self.redis.aclose()
        await self._reader.aclose()

    # --- producing ---------------------------------------------------------------------------

    async def publish(self, stream: str, msg: Message) -> str:
        """XADD with approximate MAXLEN trimming; returns the entry id. A message over the codec's
        size limit raises CodecError("oversized") before anything is sent."""
        fields = {FIELD: encode(msg)}

        async def xadd() -> Any:
            return await self.redis.xadd(stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]

        entry_id = await retry("publish", xadd, self.publish_timeout_s)
        return entry_id.decode()

    async def publish_many(self, items: list[tuple[str, Message]]) -> list[str]:
        """Many XADDs in one round trip (no transaction); ids in the order of `items`."""
        if not items:
            return []
        encoded = [(stream, {FIELD: encode(msg)}) for stream, msg in items]

        async def xadds() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for stream, fields in encoded:
                pipe.xadd(stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            return await pipe.execute()

        ids = await retry("publish_many", xadds, self.publish_timeout_s)
        return [entry_id.decode() for entry_id in ids]

    async def publish_if_exists(self, stream: str, msg: Message) -> str | None:
        """XADD NOMKSTREAM: the entry id, or None when the stream does not exist, which for a
        request stream means its consumers never created their group (nobody serves it)."""
        fields = {FIELD: encode(msg)}

        async def xadd() -> Any:
            return await self.redis.xadd(
                stream,
                fields,  # type: ignore[arg-type]
                maxlen=self.maxlen,
                approximate=True,
                nomkstream=True,
            )

        entry_id = await retry("publish", xadd, self.publish_timeout_s)
        return None if entry_id is None else entry_id.decode()

    async def publish_reply(
        self,
        stream: str,
        msg: Message,
        *,
        maxlen: int,
        ttl_s: int,
        ack: tuple[str, Delivery] | None = None,
        limit_s: float | None = None,
    ) -> None:
        """One round trip: XADD to a reply stream capped at `maxlen`, renew its expiry to
        `ttl_s` (so the stream of a caller that died goes away: a reply XADD would otherwise
        recreate it for good), and XACK the entry it answers. Retried up to `limit_s`
        (default `publish_timeout_s`)."""
        fields = {FIELD: encode(msg)}

        async def send() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(stream, fields, maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.expire(stream, ttl_s)
            if ack is not None:
                pipe.xack(ack[1].stream, ack[0], ack[1].entry_id)
            await pipe.execute()

        await retry("publish_reply", send, self.publish_timeout_s if limit_s is None else limit_s)

    # --- consumer groups ---------------------------------------------------------------------

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create the group (and the stream) unless it exists; remembered for NOGROUP recovery."""
        self._groups[(stream, group)] = start_id
        await retry(
            "ensure_group",
            lambda: self._create_group(stream, group, start_id),
            self.publish_timeout_s,
        )

    async def read_group(
        self,
        group: str,
        streams: list[str],
        *,
        count: int = 64,
        block_ms: int | None = 1000,
        own_pending: bool = False,
    ) -> list[Delivery]:
        """New entries for this consumer (XREADGROUP >), waiting up to `block_ms` (None: not at
        all). With `own_pending`, this consumer's delivered-but-unacked entries instead, from the
        oldest (never blocks; returns the same entries again until they are acked)."""
        _check_block(block_ms)
        block = None if own_pending else block_ms
        ids = dict.fromkeys(streams, "0" if own_pending else ">")
        limit_s = self._read_limit_s(block)

        async def xreadgroup() -> Any:
            async with asyncio.timeout(limit_s):
                return await self._reader.xreadgroup(
                    group,
                    self.consumer,
                    ids,  # type: ignore[arg-type]
                    count=count,
                    block=block,
                )

        while True:
            try:
                response = await retry("read_group", xreadgroup, None)
                break
            except ResponseError as exc:
                await self._recover_group(exc, group, streams)
        return await self._sort(response, group)

    async def ack(self, group: str, deliveries: Iterable[Delivery]) -> None:
        """XACK, one command per stream, pipelined. Entries Redis lost in a restart are ignored."""
        by_stream: dict[str, list[str]] = {}
        for delivery in deliveries:
            by_stream.setdefault(delivery.stream, []).append(delivery.entry_id)
        if not by_stream:
            return

        async def xack() -> None:
            pipe = self.redis.pipeline(transaction=False)
            for stream, ids in by_stream.items():
                pipe.xack(stream, group, *ids)
            await pipe.execute()

        try:
            await retry("ack", xack, self.publish_timeout_s)
        except ResponseError as exc:
            if not _is_nogroup(exc):
                raise
            log.info(
                "ack for a group Redis lost (restart); its entries are gone",
                extra={"group": group, "streams": sorted(by_stream)},
            )

    async def claim_idle(
        self, stream: str, group: str, min_idle_ms: int, count: int = 100
    ) -> list[Delivery]:
        """Take over up to `count` entries pending longer than `min_idle_ms` in other consumers
        (a crashed one's). Entries trimmed away meanwhile are dropped by Redis and skipped."""
        claimed: list[tuple[bytes | None, dict[bytes, bytes] | None]] = []
        cursor: bytes | str = "0-0"
        while len(claimed) < count:

            async def xautoclaim(start: bytes | str = cursor, n: int = count - len(claimed)) -> Any:
                return await self.redis.xautoclaim(
                    stream, group, self.consumer, min_idle_ms, start_id=start, count=n
                )

            try:
                reply = await retry("claim_idle", xautoclaim, None)
            except ResponseError as exc:
                await self._recover_group(exc, group, [stream])
                cursor = "0-0"
                continue
            cursor = reply[0]
            claimed.extend(reply[1])
            if cursor == b"0-0":
                break
        return await self._sort([(stream.encode(), claimed)], group)

    async def dead_letter(
        self, delivery: Delivery, reason: str, detail: str, group: str | None = None
    ) -> None:
        """Move a decoded entry the consumer cannot use aside, as undecodable ones are (logged,
        counted, recorded, and acked in `group`); never raises."""
        bad = Rejected(delivery.stream, delivery.entry_id, reason, detail, encode(delivery.message))
        await self._discard([bad], [], group)

    # --- fan-out -----------------------------------------------------------------------------

    async def read(
        self, last_ids: dict[str, str], *, count: int = 64, block_ms: int | None = 1000
    ) -> list[Delivery]:
        """Plain XREAD after `last_ids` (stream -> id), which advance in place past everything
        read, bad entries included. A "$" is pinned to the stream's current last entry on first
        use, so nothing published between two calls is missed. Nothing is acked here, and every
        fan-out reader dead-letters the bad entries it meets (one record per reader)."""
        _check_block(block_ms)
        if "$" in last_ids.values():
            await self._pin_latest(last_ids)
        ids = dict(last_ids)
        limit_s = self._read_limit_s(block_ms)

        async def xread() -> Any:
            async with asyncio.timeout(limit_s):
                return await self._reader.xread(ids, count=count, block=block_ms)  # type: ignore[arg-type]

        response = await retry("read", xread, None)
        for name, entries in response:
            if entries:
                last_ids[name.decode()] = entries[-1][0].decode()
        return await self._sort(response, None)

    # --- internals ---------------------------------------------------------------------------

    def _read_limit_s(self, block_ms: int | None) -> float:
        return (block_ms or 0) / 1000 + self.op_timeout_s

    async def _create_group(self, stream: str, group: str, start_id: str) -> None:
        try:
            await self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _recover_group(self, exc: ResponseError, group: str, streams: list[str]) -> None:
        """Recreate groups Redis lost (NOGROUP after a restart; UNBLOCKED when the stream was
        deleted under a blocked read, e.g. by FLUSHALL); re-raise anything else, and either for
        a group this bus never ensured (a caller bug, not an outage)."""
        lost = _is_nogroup(exc) or str(exc).startswith("UNBLOCKED")
        if not lost or any((s, group) not in self._groups for s in streams):
            raise exc
        log.warning(
            "consumer group %s missing (Redis restarted?), recreating it on %s",
            group,
            streams,
            extra={"group": group, "streams": streams},
        )
        for stream in streams:
            create = partial(self._create_group, stream, group, self._groups[(stream, group)])
            await retry("ensure_group", create, None)

    async def _pin_latest(self, last_ids: dict[str, str]) -> None:
        pinned = [stream for stream, last in last_ids.items() if last == "$"]

        async def xrevranges() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for stream in pinned:
                pipe.xrevrange(stream, count=1)
            return await pipe.execute()

        for stream, newest in zip(pinned, await retry("read", xrevranges, None), strict=True):
            last_ids[stream] = newest[0][0].decode() if newest else "0-0"

    async def _sort(
        self, response: Iterable[tuple[bytes, RawEntries]], group: str | None
    ) -> list[Delivery]:
        """Decode a read's entries in stream order; dead-letter (and, in a group, ack) the bad
        ones, ack pending entries whose payload was trimmed away, return the good ones."""
        deliveries: list[Delivery] = []
        rejected: list[Rejected] = []
        trimmed: list[tuple[str, str]] = []
        for name, entries in response:
            stream = name.decode()
            for raw_id, fields in entries:
                if raw_id is None:  # a claimed entry deleted meanwhile (Redis < 7 reports these)
                    continue
                if not fields:  # a pending entry trimmed before it was processed
                    trimmed.append((stream, raw_id.decode()))
                    continue
                item = decode_entry(stream, raw_id.decode(), fields)
                if type(item) is Delivery:
                    deliveries.append(item)
                else:
                    rejected.append(item)  # type: ignore[arg-type]
        if rejected or trimmed:
            await self._discard(rejected, trimmed, group)
        return deliveries

    async def _discard(
        self, rejected: list[Rejected], trimmed: list[tuple[str, str]], group: str | None
    ) -> None:
        """Dead-letter and ack in one round trip. A failure here is logged, never raised: the
        good entries of the same read must still reach the caller."""
        for bad in rejected:
            DEAD_LETTERS.labels(bad.stream, bad.reason).inc()
            log.warning(
                "dead-lettered entry %s of %s: %s (%s)",
                bad.entry_id,
                bad.stream,
                bad.reason,
                bad.detail,
                extra={
                    "stream": bad.stream,
                    "entry_id": bad.entry_id,
                    "reason": bad.reason,
                    "detail": bad.detail,
                },
            )
        for stream, entry_id in trimmed:
            log.warning(
                "pending entry %s of %s was trimmed before it was processed",
                entry_id,
                stream,
                extra={"stream": stream, "entry_id": entry_id},
            )

        async def record() -> None:
            pipe = self.redis.pipeline(transaction=False)
            if self.dead_letter_stream is not None:
                for bad in rejected:
                    pipe.xadd(
                        self.dead_letter_stream,
                        bad.record(self.consumer),  # type: ignore[arg-type]
                        maxlen=self.maxlen,
                        approximate=True,
                    )
            if group is not None:
                for stream, entry_id in [(b.stream, b.entry_id) for b in rejected] + trimmed:
                    pipe.xack(stream, group, entry_id)
            if len(pipe):
                await pipe.execute()

        try:
            await retry("dead_letter", record, self.publish_timeout_s)
        except (BusUnavailable, ResponseError) as exc:
            log.error("could not record dead letters: %s", exc, extra={"error": str(exc)})


def _check_block(block_ms: int | None) -> None:
    # Redis reads BLOCK 0 as "forever", which no dead-connection deadline could bound.
    if block_ms is not None and block_ms <= 0:
        raise ValueError(f"block_ms must be None (no wait) or > 0, got {block_ms}")


def _is_nogroup(exc: ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")
