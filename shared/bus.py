"""The Redis-streams bus: publish messages, consume them through groups or fan-out reads.

Every entry is one field `m` holding `shared.codec.encode(msg)`. Consumers get decoded
`Delivery`s in stream order; an entry that does not decode never reaches them: it is copied to
the dead-letter stream with its reason, counted, logged, acknowledged, and reading goes on.

Delivery is at least once. A retried publish whose first attempt did reach Redis before the
connection broke adds the entry twice, and an unacknowledged entry is delivered again (own
pending entries, or claimed by another consumer); handlers are idempotent by request/step id.

Streams stay bounded: a consumer deletes each entry it acks (XACK + XDEL), and fan-out streams
keep `retention_s` of history (shared/streams.py `trimmed_by_age`).

Every operation survives a Redis outage of any length: a lost connection is retried with
exponential backoff (50 ms doubling to 2 s, jittered). Reads, connecting and group creation retry
for as long as it takes (a consumer has nothing better to do); writes give up with
`BusUnavailable` after `publish_timeout_s` unless the caller asks for a `patient` one (a
service's own loop, whose work is not lost by waiting: a step result, a plan). Redis runs without
persistence, so a restart also loses the consumer groups: the bus remembers the groups it ensured
and recreates them when Redis answers NOGROUP, or when a blocked group read is unblocked because
its stream was deleted (a DEL of a consumed stream is the same loss, by hand).

A batch publish whose Redis answers refuse some entries (an ACL that forbids a stream) writes the
others and raises `PublishRefused`, which says which went through: one bad destination must not
cost the step its plan.

Blocking reads go through a second client without a socket timeout, each bounded instead by
`asyncio.timeout(block + op_timeout_s)`: a read that outlives its BLOCK by that much is on a dead
connection, is dropped, and retried. Everything else uses `redis` with `op_timeout_s` socket
timeouts. redis-py's own retries are off: one retry policy, in `shared.bus_retry`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from shared.bus_entry import DEAD_LETTERS, FIELD, Delivery, Rejected, decode_entry, failed_entry
from shared.bus_retry import BusUnavailable, retry
from shared.codec import encode
from shared.protocol import Message
from shared.streams import trimmed_by_age

__all__ = ["DEAD_LETTERS", "Bus", "BusUnavailable", "Delivery", "PublishRefused"]

log = logging.getLogger(__name__)

# Raw XREAD/XREADGROUP/XAUTOCLAIM entries: [(entry_id, {field: value}), ...] per stream.
RawEntries = Sequence[tuple[bytes | None, dict[bytes, bytes] | None]]


class PublishRefused(Exception):
    """Redis refused some entries of a batch (`errors`: index -> its error reply); `ids` holds
    the entry id of every item that was written, None for the refused ones."""

    def __init__(self, ids: list[str | None], errors: dict[int, ResponseError]) -> None:
        first = next(iter(errors.values()))
        super().__init__(f"{len(errors)} of {len(ids)} entries refused: {first}")
        self.ids = ids
        self.errors = errors


class Bus:
    def __init__(
        self,
        redis_url: str,
        consumer: str,
        *,
        maxlen: int = 100_000,
        retention_s: float | None = None,
        dead_letter_stream: str | None = None,
        publish_timeout_s: float = 30.0,
        connect_timeout_s: float | None = None,
        op_timeout_s: float = 5.0,
    ) -> None:
        """`consumer` names this process in consumer groups; keep it stable across restarts so
        `read_group(own_pending=True)` finds what it read before. Without `dead_letter_stream`,
        bad entries are only logged and counted. `connect_timeout_s` None: `connect` waits for
        Redis however long it takes. Trimming (shared/streams.py `trimmed_by_age`): with
        `retention_s`, fan-out streams keep that much history (XADD MINID ~); the others keep
        `maxlen` entries (MAXLEN ~), and their consumers delete what they ack."""
        self.consumer = consumer
        self.maxlen = maxlen
        self.retention_s = retention_s
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
        self._rejection_watchers: dict[str, Callable[[Rejected], None]] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> None:
        """Wait for Redis to answer a PING (it may still be starting); BusUnavailable past
        `connect_timeout_s` when one is set."""
        await retry("connect", self.redis.ping, self.connect_timeout_s)

    async def close(self) -> None:
        await self.redis.aclose()
        await self._reader.aclose()

    # --- producing ---------------------------------------------------------------------------

    async def publish(self, stream: str, msg: Message, *, patient: bool = False) -> str:
        """XADD with approximate MAXLEN trimming; returns the entry id. A message over the codec's
        size limit raises CodecError("oversized") before anything is sent. `patient`: retry
        until Redis answers instead of giving up after `publish_timeout_s`."""
        entry_id = await self._xadd(stream, msg, patient=patient, create=True)
        assert entry_id is not None  # XADD without NOMKSTREAM always adds
        return entry_id

    async def publish_if_exists(self, stream: str, msg: Message) -> str | None:
        """`publish` into a stream only if it exists (XADD NOMKSTREAM); None when it does not.
        For a note to a reader that may be gone: writing must not re-create its expired
        stream, which nobody would delete again."""
        return await self._xadd(stream, msg, patient=False, create=False)

    async def _xadd(self, stream: str, msg: Message, *, patient: bool, create: bool) -> str | None:
        fields = {FIELD: encode(msg)}

        async def xadd() -> Any:
            return await self.redis.xadd(
                stream,
                fields,  # type: ignore[arg-type]
                **self._trim(stream),
                nomkstream=not create,
            )

        entry_id = await retry("publish", xadd, None if patient else self.publish_timeout_s)
        return None if entry_id is None else entry_id.decode()

    async def publish_many(
        self,
        items: list[tuple[str, Message]],
        *,
        patient: bool = False,
        expire_if_unset: Mapping[str, int] | None = None,
    ) -> list[str]:
        """Many XADDs in one round trip (no transaction); ids in the order of `items`.
        PublishRefused when Redis refused some of them (the others are written).
        `expire_if_unset` {stream: ttl_s}: give each such stream that expiry unless it already
        has one (EXPIRE NX), so a stream whose reader died and let it expire, re-created by
        this XADD, expires again instead of staying for good."""
        if not items:
            return []
        encoded = [(stream, {FIELD: encode(msg)}) for stream, msg in items]
        written = {stream for stream, _ in encoded}
        expiries = {s: t for s, t in (expire_if_unset or {}).items() if s in written}

        async def xadds() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for stream, fields in encoded:
                pipe.xadd(stream, fields, **self._trim(stream))  # type: ignore[arg-type]
            for stream, ttl_s in expiries.items():
                pipe.expire(stream, ttl_s, nx=True)
            return (await pipe.execute(raise_on_error=False))[: len(encoded)]

        replies = await retry("publish_many", xadds, None if patient else self.publish_timeout_s)
        errors = {i: r for i, r in enumerate(replies) if isinstance(r, ResponseError)}
        ids = [None if i in errors else r.decode() for i, r in enumerate(replies)]
        if errors:
            raise PublishRefused(ids, errors)
        return ids  # type: ignore[return-value]

    def _trim(self, stream: str) -> dict[str, Any]:
        """XADD's trimming arguments for `stream`: by age or by length (see __init__)."""
        if self.retention_s is not None and trimmed_by_age(stream):
            oldest_ms = max(0, int((time.time() - self.retention_s) * 1000))
            return {"minid": f"{oldest_ms}-0", "approximate": True}
        return {"maxlen": self.maxlen, "approximate": True}

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
        recreate it for good), and XACK (and delete) the entry it answers. Retried up to `limit_s`
        (default `publish_timeout_s`)."""
        fields = {FIELD: encode(msg)}

        async def send() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(stream, fields, maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.expire(stream, ttl_s)
            if ack is not None:
                pipe.xack(ack[1].stream, ack[0], ack[1].entry_id)
                pipe.xdel(ack[1].stream, ack[1].entry_id)
            await pipe.execute()

        await retry("publish_reply", send, self.publish_timeout_s if limit_s is None else limit_s)

    # --- consumer groups ---------------------------------------------------------------------

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        """Create the group (and the stream) unless it exists; remembered for NOGROUP recovery."""
        self._groups[(stream, group)] = start_id
        await retry("ensure_group", lambda: self._create_group(stream, group, start_id), None)

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
        oldest (never blocks; returns the same entries again until they are acked), each with
        its delivery count."""
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
        deliveries = await self._sort(response, group)
        return await self._with_counts(group, deliveries) if own_pending else deliveries

    async def ack(self, group: str, deliveries: Iterable[Delivery]) -> None:
        """XACK and XDEL, one of each per stream, pipelined: an acked entry is done (every
        stream read through a group has that one group), and deleting it is what keeps the
        stream short. Entries Redis lost (a restart, a DEL of the stream) are ignored."""
        by_stream: dict[str, list[str]] = {}
        for delivery in deliveries:
            by_stream.setdefault(delivery.stream, []).append(delivery.entry_id)
        if not by_stream:
            return

        async def xack() -> None:
            pipe = self.redis.pipeline(transaction=False)
            for stream, ids in by_stream.items():
                pipe.xack(stream, group, *ids)
                pipe.xdel(stream, *ids)
            await pipe.execute()

        try:
            # Retried until through: an ack given up on is an entry delivered again, and no
            # caller could do better than wait for Redis either.
            await retry("ack", xack, None)
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
        (a crashed one's), each with its delivery count. Entries trimmed away meanwhile are
        dropped by Redis and skipped."""
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
        deliveries = await self._sort([(stream.encode(), claimed)], group)
        return await self._with_counts(group, deliveries)

    async def dead_letter(self, group: str | None, failed: list[tuple[Delivery, str, str]]) -> None:
        """Give up on decoded entries: (delivery, reason, detail) each goes to the dead-letter
        stream and, read through `group`, is acked, so it is never delivered again. Logged and
        counted like undecodable entries; a failure to record is logged, never raised (the
        entry then stays pending and comes back with a higher delivery count)."""
        if failed:
            rejected = [failed_entry(d, reason, detail) for d, reason, detail in failed]
            await self._discard(rejected, [], group)

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

    def watch_rejections(self, stream: str, callback: Callable[[Rejected], None]) -> None:
        """Call `callback` with every entry of `stream` that did not decode, once it is
        dead-lettered (a consumer may still salvage who should hear about it)."""
        self._rejection_watchers[stream] = callback

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
        """Recreate groups Redis lost (NOGROUP after a restart or a DEL of the stream; UNBLOCKED
        for a read that was blocked on a stream deleted meanwhile); re-raise anything else, and
        a lost group this bus never ensured (a caller bug, not an outage)."""
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

    async def _with_counts(self, group: str, deliveries: list[Delivery]) -> list[Delivery]:
        """The deliveries with their group delivery counts (XPENDING, one per entry, pipelined);
        an entry acked meanwhile keeps 1."""
        if not deliveries:
            return deliveries

        async def xpendings() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for d in deliveries:
                pipe.xpending_range(d.stream, group, min=d.entry_id, max=d.entry_id, count=1)
            return await pipe.execute(raise_on_error=False)

        replies = await retry("delivery_counts", xpendings, None)
        counted = []
        for delivery, reply in zip(deliveries, replies, strict=True):
            if isinstance(reply, list) and reply:
                delivery = replace(delivery, deliveries=int(reply[0]["times_delivered"]))
            counted.append(delivery)
        return counted

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
        for bad in rejected:
            watcher = self._rejection_watchers.get(bad.stream)
            if watcher is not None:
                try:
                    watcher(bad)
                except Exception:
                    log.exception("rejection watcher of %s failed", bad.stream)
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
                    pipe.xdel(stream, entry_id)
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
