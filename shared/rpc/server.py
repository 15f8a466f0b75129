"""The serving side: a consumer group on the service's `calls` stream, one handler per call type.

Per request: check the envelope (shared.rpc.envelope; a bad one is dead-lettered), skip it if
its deadline passed, run its handler, and publish the answer to the request's reply stream and
ack the request in one round trip. A handler that raises gets an error answer (`RpcError` its
own kind, anything else "internal"); the loop never dies of a request. Entries that do not
decode are dead-lettered by the Bus before they get here. `Ping` is answered by the server
itself, so every served stream can be probed.

`concurrency=1` serves requests one at a time in stream order: a caller that waits for each
answer before its next call then sees its calls take effect in the order it made them (the
kvstore relies on this). Above 1, up to that many handlers run at once (the grammar service:
compilations take milliseconds to seconds).

Entries pending longer than `claim_idle_ms` (a crashed replica's, or an answer that could not
be published) are claimed with XAUTOCLAIM and served again, unless expired by then. Answers go
out even when a request is served twice: the caller takes the first, the other is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client import Counter
from redis.exceptions import ResponseError

from shared.bus import Bus, BusUnavailable, Delivery
from shared.codec import CodecError
from shared.metrics import metric_name
from shared.protocol import Ping, Pong, RpcErrorReply, RpcReply, RpcRequest
from shared.rpc.envelope import envelope_problem, expired
from shared.rpc.errors import RpcError
from shared.stopping import unless_stopped
from shared.streams import RPC_GROUP

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[RpcReply]]

READ_BLOCK_MS = 1000
REPLY_MAXLEN = 10_000  # a live caller reads its replies at once; this only bounds a dead one's
REPLY_TTL_S = 300  # a reply stream outlives its last reply by this much
MAX_ERROR_CHARS = 4096

SERVED = Counter(
    metric_name("rpc_served"),
    "Calls a server took from its stream, by request type and outcome",
    ["type", "outcome"],
)


class RpcServer:
    def __init__(
        self,
        bus: Bus,
        stream: str,
        handlers: Mapping[type[RpcRequest], Handler],
        *,
        service: str,
        instance_id: str,
        reply_prefix: str,
        concurrency: int = 1,
        claim_idle_ms: int = 15_000,
        group: str = RPC_GROUP,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.handlers = dict(handlers)
        self.service = service
        self.instance_id = instance_id
        self.reply_prefix = reply_prefix
        self.concurrency = max(1, concurrency)
        self.claim_idle_ms = claim_idle_ms
        self.group = group
        self._slots = asyncio.Semaphore(self.concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self.served = 0  # requests whose handler ran

    async def start(self) -> None:
        """Create the stream and its group: from now on, calls are accepted (and queue up
        until `run` reads them)."""
        await self.bus.ensure_group(self.stream, self.group)

    async def run(self, stopping: asyncio.Event) -> None:
        """Serve until `stopping` is set (a read in progress is given up: its entries stay
        pending for a claim), then let the handlers in flight finish."""
        loop = asyncio.get_running_loop()
        # What this consumer took before a restart and never answered: served now if the
        # caller still waits, instead of after `claim_idle_ms`.
        own = self.bus.read_group(self.group, [self.stream], own_pending=True)
        await self._serve_all(await unless_stopped(own, stopping) or [])
        next_claim = loop.time() + self.claim_idle_ms / 1000
        try:
            while not stopping.is_set():
                read = self.bus.read_group(
                    self.group, [self.stream], count=64, block_ms=READ_BLOCK_MS
                )
                await self._serve_all(await unless_stopped(read, stopping) or [])
                if loop.time() >= next_claim and not stopping.is_set():
                    next_claim = loop.time() + self.claim_idle_ms / 1000
                    claim = self.bus.claim_idle(self.stream, self.group, self.claim_idle_ms)
                    await self._serve_all(await unless_stopped(claim, stopping) or [])
        finally:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve_all(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            if self.concurrency == 1:
                await self.serve(delivery)
                continue
            await self._slots.acquire()
            task = asyncio.create_task(self.serve(delivery), name="rpc-handler")
            self._tasks.add(task)
            task.add_done_callback(self._handler_done)

    def _handler_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def serve(self, delivery: Delivery) -> None:
        """Answer one request (or dead-letter or skip it) and ack it. Never raises."""
        msg = delivery.message
        problem = envelope_problem(msg, self.reply_prefix)
        if problem is not None:
            SERVED.labels(msg.TYPE, "rejected").inc()
            await self.bus.dead_letter(self.group, [(delivery, "bad_envelope", problem)])
            return
        assert isinstance(msg, RpcRequest)
        if expired(msg.deadline, time.time()):
            SERVED.labels(msg.TYPE, "expired").inc()
            await self._ack(delivery)
            return
        reply = await self._answer(msg)
        self.served += 1  # handled: counted before its answer can reach the caller
        try:
            outcome = await self._publish(msg, reply, delivery)
        except CodecError as exc:  # the answer does not encode (too large): say so instead
            log.error("the answer to %s does not encode: %s", msg.TYPE, exc)
            error = _error("internal", f"the answer to {msg.TYPE} does not encode: {exc}")
            outcome = await self._publish(msg, error, delivery)
        SERVED.labels(msg.TYPE, outcome).inc()

    async def _publish(self, msg: RpcRequest, reply: RpcReply, delivery: Delivery) -> str:
        """Answer and ack in one round trip; the outcome for the metric."""
        reply.correlation_id = msg.correlation_id
        try:
            await self.bus.publish_reply(
                msg.reply_stream,
                reply,
                maxlen=REPLY_MAXLEN,
                ttl_s=REPLY_TTL_S,
                ack=(self.group, delivery),
                limit_s=max(0.0, msg.deadline - time.time()),
            )
        except (BusUnavailable, ResponseError) as exc:
            # Left pending: claimed again after claim_idle_ms, and dropped then if expired.
            log.warning(
                "could not answer %s on %s: %s",
                msg.TYPE,
                msg.reply_stream,
                exc,
                extra={"type": msg.TYPE, "reply_stream": msg.reply_stream, "error": str(exc)},
            )
            return "unanswered"
        return "error" if isinstance(reply, RpcErrorReply) else "ok"

    async def _answer(self, msg: RpcRequest) -> RpcReply:
        if isinstance(msg, Ping):
            return Pong(service=self.service, instance_id=self.instance_id)
        handler = self.handlers.get(type(msg))
        if handler is None:
            return _error("bad_request", f"{self.service} does not answer {msg.TYPE} calls")
        try:
            return await handler(msg)
        except RpcError as exc:
            return _error(exc.kind, exc.message)
        except Exception as exc:
            log.exception("the %s handler failed", msg.TYPE, extra={"type": msg.TYPE})
            return _error("internal", f"{type(exc).__name__}: {exc}")

    async def _ack(self, delivery: Delivery) -> None:
        try:
            await self.bus.ack(self.group, [delivery])
        except (BusUnavailable, ResponseError) as exc:
            log.warning("could not ack %s: %s", delivery.entry_id, exc)

    def state(self) -> dict[str, Any]:
        return {
            "stream": self.stream,
            "served": self.served,
            "in_flight": len(self._tasks),
            "concurrency": self.concurrency,
        }


def _error(kind: Any, message: str) -> RpcErrorReply:
    return RpcErrorReply(kind=kind, message=message[:MAX_ERROR_CHARS])
