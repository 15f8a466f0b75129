"""The calling side: `RpcClient.call(stream, request, expect, timeout_s) -> reply`.

One client per process and calling service. Its reply stream (Streams.rpc_replies) is read by
one background task with plain XREAD BLOCK, which hands each reply to its waiting call by
correlation id (shared.rpc.pending); a call never reads Redis itself, so a thousand calls in
flight cost one blocking read, not a thousand. Servers cap the reply stream and renew its
expiry with every reply, so the stream of a process that died goes away.

A call is sent with XADD NOMKSTREAM: a request stream that does not exist has never had a
server (servers create it with their consumer group), and the call fails at once with
`RpcUnavailable` instead of waiting out its timeout. A call that gets no answer in time raises
`RpcTimeout`; an error answer raises `RpcError`. `attempts > 1` sends the request again (same
correlation id, the first answer wins) when a share of the timeout passed without an answer:
only for requests that are safe to run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TypeVar

from prometheus_client import Counter, Histogram

from shared.bus import Bus, BusUnavailable
from shared.metrics import metric_name
from shared.protocol import RpcErrorReply, RpcReply, RpcRequest
from shared.rpc.envelope import reply_stream_problem
from shared.rpc.errors import RpcCallError, RpcError, RpcTimeout, RpcUnavailable
from shared.rpc.pending import PendingCalls

log = logging.getLogger(__name__)

R = TypeVar("R", bound=RpcReply)

READ_BLOCK_MS = 1000

CALLS = Counter(
    metric_name("rpc_calls"),
    "Calls made over the bus, by request type and outcome",
    ["type", "outcome"],
)
CALL_SECONDS = Histogram(
    metric_name("rpc_call_seconds"),
    "Time from sending a call to its answer (answered calls only)",
    ["type"],
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5, 10, 30),
)
DROPPED_REPLIES = Counter(
    metric_name("rpc_dropped_replies"), "Replies no call waited for (late, or a retry's twin)"
)


class RpcClient:
    def __init__(self, bus: Bus, reply_stream: str, reply_prefix: str) -> None:
        """`reply_stream` must be under `reply_prefix` (Streams.rpc_replies/rpc_reply_prefix):
        a server refuses to answer anywhere else."""
        problem = reply_stream_problem(reply_stream, reply_prefix)
        if problem is not None:
            raise ValueError(problem)
        self.bus = bus
        self.reply_stream = reply_stream
        self._pending = PendingCalls()
        self._reader: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        # Pin the read position now: a reply published before the reader's first XREAD must
        # not be skipped, and replies to a previous process of this instance are not ours.
        last_ids = {self.reply_stream: "$"}
        await self.bus.read(last_ids, block_ms=None)
        self._reader = asyncio.create_task(self._read_replies(last_ids), name="rpc-replies")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._pending.fail_all(RpcUnavailable("the rpc client stopped"))

    async def call(
        self,
        stream: str,
        request: RpcRequest,
        expect: type[R],
        timeout_s: float,
        *,
        attempts: int = 1,
    ) -> R:
        """Send `request` on `stream` and return its `expect` answer. Raises RpcTimeout,
        RpcUnavailable or RpcError (the callee's error answer, or an answer of another type)."""
        if self._reader is None:
            raise RpcUnavailable("the rpc client is not started")
        correlation_id, answer = self._pending.open()
        msg = request.model_copy(
            update={
                "correlation_id": correlation_id,
                "reply_stream": self.reply_stream,
                "deadline": time.time() + timeout_s,
            }
        )
        started = time.perf_counter()
        try:
            reply = await self._exchange(stream, msg, answer, timeout_s, max(1, attempts))
            CALL_SECONDS.labels(request.TYPE).observe(time.perf_counter() - started)
            result = _unwrap(reply, expect)
        except RpcCallError as exc:
            CALLS.labels(request.TYPE, _OUTCOMES[type(exc)]).inc()
            raise
        finally:
            self._pending.close(correlation_id)
        CALLS.labels(request.TYPE, "ok").inc()
        return result

    async def _exchange(
        self,
        stream: str,
        msg: RpcRequest,
        answer: asyncio.Future[RpcReply],
        timeout_s: float,
        attempts: int,
    ) -> RpcReply:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        for attempt in range(attempts):
            try:
                await self._send(stream, msg, end - loop.time())
            except RpcUnavailable:
                if attempt == 0:
                    raise
                # A retry that cannot be sent: the first attempt is out, keep waiting for it.
            # The attempts share what is left of the timeout equally. The answer is shielded:
            # a wait that times out must not cancel it for the next attempt.
            wait_until = loop.time() + (end - loop.time()) / (attempts - attempt)
            try:
                async with asyncio.timeout_at(wait_until):
                    return await asyncio.shield(answer)
            except TimeoutError:
                continue
        raise RpcTimeout(f"no answer to {msg.TYPE} on {stream} within {timeout_s:g} s")

    async def _send(self, stream: str, msg: RpcRequest, left_s: float) -> None:
        try:
            async with asyncio.timeout(max(0.0, left_s)):
                entry_id = await self.bus.publish_if_exists(stream, msg)
        except (TimeoutError, BusUnavailable, ConnectionError) as exc:
            raise RpcUnavailable(f"cannot send {msg.TYPE} on {stream}: Redis: {exc}") from None
        if entry_id is None:
            raise RpcUnavailable(f"nobody serves {stream} (the stream does not exist)")

    async def _read_replies(self, last_ids: dict[str, str]) -> None:
        """Runs for the client's life. The bus rides out Redis outages itself; anything else is
        logged and reading goes on, so one bad entry never stops the replies behind it."""
        while True:
            try:
                deliveries = await self.bus.read(last_ids, count=256, block_ms=READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading the rpc reply stream failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                reply = delivery.message
                if not isinstance(reply, RpcReply):
                    log.warning("unexpected %s on the rpc reply stream", reply.TYPE)
                elif not self._pending.resolve(reply):
                    DROPPED_REPLIES.inc()


_OUTCOMES: dict[type[RpcCallError], str] = {
    RpcTimeout: "timeout",
    RpcUnavailable: "unavailable",
    RpcError: "error",
}


def _unwrap(reply: RpcReply, expect: type[R]) -> R:
    if isinstance(reply, RpcErrorReply):
        raise RpcError(reply.kind, reply.message)
    if not isinstance(reply, expect):
        raise RpcError("internal", f"expected a {expect.TYPE} answer, got {reply.TYPE}")
    return reply
