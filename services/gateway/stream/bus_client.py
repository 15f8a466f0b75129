"""The gateway's side of the bus: submit requests, route replies to them, abort them.

- Submitting a plan publishes one SubmitRequest per choice on the requests stream. When the
  client gave no seed, one is drawn here (`secrets.randbits(63)`) and logged, so every sample
  can be reproduced; choice i of a prompt is sampled with `seed + i`.
- Each gateway instance has one reply stream, read by one background task (plain XREAD); each
  RequestDelta goes to its request's queue after de-duplication by output index (a restarted
  scheduler regenerates from the start). Replies for unknown ids (finished, aborted) are dropped.
- Each request goes to the stream `destination` names (the router's group, services/gateway/
  route), which may refuse it (429 when every group's queue is full) before anything is queued.
- Backpressure: at most `max_pending` scheduler requests in flight; past that, 429 with
  Retry-After. A sub-request stops counting when its final delta arrives or it is aborted.
- Aborts (client gone, stop string, timeout) are published from tasks the client owns, so a
  cancelled HTTP handler still gets its abort out.
- The reply stream expires `reply_stream_ttl_s` after this gateway last refreshed it (every
  `refresh_interval_s`, with its heartbeat): a dead gateway's stream disappears by itself. The
  gateway creates it empty at start and again whenever Redis lost it, so it carries a TTL from
  its first moment (a scheduler's XADD would create it without one); schedulers abort the
  requests of a gateway whose heartbeats stopped (services/scheduler/gateway_watch.py).
- A request can also be failed from the gateway's side (`fail_in_flight`: it is shutting down
  and its drain ran out of time): its waiter gets the error instead of the next delta, so the
  client reads an error body or event rather than a cut connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import ResponseError

from services.gateway.api.errors import OpenAIError, invalid_request
from services.gateway.plan.request_plan import RequestPlan
from services.gateway.stream.reply_dedup import MalformedDelta, ReplyCursor
from services.gateway.stream.submit_batcher import SubmitBatcher
from shared.bus import Bus, BusUnavailable, PublishRefused
from shared.protocol import AbortRequest, RequestDelta, SubmitRequest, TokenDelta
from shared.streams import Streams

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
READ_BLOCK_MS = 1000
# XGROUP CREATE ... MKSTREAM is the one command that makes an empty stream; the group itself is
# never read (replies are read with plain XREAD).
KEEPALIVE_GROUP = "ttl"


@dataclass
class _SubRequest:
    handle: RequestHandle
    choice: int
    cursor: ReplyCursor


class RequestHandle:
    """The in-flight choices of one API request. `close()` must be called (routes do it in a
    `finally`): it aborts what is still running and frees the slots."""

    def __init__(self, client: GatewayBusClient, plan: RequestPlan, seed: int) -> None:
        self.client = client
        self.plan = plan
        self.seed = seed
        self.request_ids = [plan.choice_request_id(c) for c in range(plan.num_choices)]
        self.queue: asyncio.Queue[tuple[int, RequestDelta] | None] = asyncio.Queue()
        self.failure: OpenAIError | None = None  # set by `fail`; None (queued) wakes the waiter
        self.open = set(range(plan.num_choices))  # choices the engine may still be running

    async def next_delta(self, timeout_s: float | None) -> tuple[int, RequestDelta]:
        """(choice index, fresh delta); TimeoutError past `timeout_s`; the OpenAIError the
        request was failed with (`fail`), on this call and every later one."""
        if self.failure is None:
            async with asyncio.timeout(timeout_s):
                item = await self.queue.get()
            if item is not None:
                return item
        assert self.failure is not None
        raise self.failure

    def queued_deltas(self) -> list[tuple[int, RequestDelta]]:
        """The deltas already waiting, taken without waiting (none once the request failed):
        what a consumer that fell behind the engine sends on as one update per choice."""
        ready: list[tuple[int, RequestDelta]] = []
        while self.failure is None and not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not None:
                ready.append(item)
        return ready

    def fail(self, error: OpenAIError) -> None:
        """End the request from the gateway's side: the waiter gets `error`. The route's
        `close()` then aborts what still runs on the engine."""
        self.failure = error
        self.queue.put_nowait(None)

    def abort(self, choice: int, reason: str) -> None:
        """Stop one choice on the scheduler (e.g. a stop string matched)."""
        if choice in self.open:
            self.open.discard(choice)
            self.client._release(self.request_ids[choice])
            self.client.abort_soon([self.request_ids[choice]], reason)

    def close(self, reason: str = "client") -> None:
        """Abort every choice still running and release its slot. Idempotent, never awaits."""
        running = sorted(self.open)
        self.open.clear()
        for choice in running:
            self.client._release(self.request_ids[choice])
        if running:
            self.client.abort_soon([self.request_ids[c] for c in running], reason)


class GatewayBusClient:
    def __init__(
        self,
        bus: Bus,
        streams: Streams,
        instance_id: str,
        *,
        max_pending: int,
        reply_stream_ttl_s: int = 120,
        refresh_interval_s: float = 1.0,
        destination: Callable[[SubmitRequest], str] | None = None,
        released: Callable[[str], None] | None = None,
    ) -> None:
        """`destination`: the stream each request goes to (the router's choice; it may raise
        the OpenAIError that refuses it); default the shared requests stream. `released`: told
        the id of every request that ends here (the router's load accounting)."""
        self.bus = bus
        self.streams = streams
        self.reply_stream = streams.replies(instance_id)
        self.max_pending = max_pending
        self.reply_stream_ttl_s = reply_stream_ttl_s
        self.refresh_interval_s = refresh_interval_s
        self.destination = destination or (lambda _request: streams.requests)
        self.released = released or (lambda _request_id: None)
        self._subs: dict[str, _SubRequest] = {}
        self.submits = SubmitBatcher(bus)
        self._reader: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._aborts: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._subs)

    async def start(self) -> None:
        # Pin the read position now, not when the reader task first runs: a reply published
        # between start() and that first read would otherwise be skipped.
        last_ids = {self.reply_stream: "$"}
        await self.bus.read(last_ids, block_ms=None)
        self._reader = asyncio.create_task(self._read_replies(last_ids), name="gateway-replies")
        self._keeper = asyncio.create_task(self._keep_reply_stream(), name="reply-stream-ttl")

    async def stop(self) -> None:
        self._closing.set()
        await self.submits.close()
        for task in (self._reader, self._keeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # --- submitting --------------------------------------------------------------------------

    async def submit(self, plan: RequestPlan) -> RequestHandle:
        if plan.num_choices > self.max_pending:
            raise invalid_request(
                f"this request needs {plan.num_choices} concurrent generations, more than the "
                f"gateway's limit of {self.max_pending}",
                "n",
            )
        if self.in_flight + plan.num_choices > self.max_pending:
            raise OpenAIError(
                429,
                f"too many requests in flight ({self.in_flight}/{self.max_pending}); retry later",
                type_="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        seed = plan.seed if plan.seed is not None else secrets.randbits(63)
        handle = RequestHandle(self, plan, seed)
        requests = plan.submit_requests(seed, self.reply_stream, time.time())
        routed: list[tuple[str, SubmitRequest]] = []
        try:
            for req in requests:
                routed.append((self.destination(req), req))
        except OpenAIError:  # refused (429): none queued, and the routed ones end here
            for _stream, req in routed:
                self.released(req.request_id)
            raise
        # Register before publishing: a reply may be read before publish_many returns.
        for choice, req in enumerate(requests):
            self._subs[req.request_id] = _SubRequest(handle, choice, ReplyCursor(req.request_id))
        self._idle.clear()
        try:
            await self.submits.publish(routed)  # type: ignore[arg-type]
        except (BusUnavailable, ConnectionError, PublishRefused) as exc:
            handle.open.clear()
            for req in requests:
                self._release(req.request_id)
            what = "is unreachable"
            if isinstance(exc, PublishRefused):  # some choices may be queued: take them back
                what = "refused the request"
                written = [r.request_id for r, i in zip(requests, exc.ids, strict=True) if i]
                if written:
                    self.abort_soon(written, "error")
            raise OpenAIError(
                503, f"the request queue {what}: {exc}", type_="service_unavailable"
            ) from None
        log.info(
            "submitted %s: %d choice(s), seed %d%s",
            plan.request_id,
            plan.num_choices,
            seed,
            "" if plan.seed is None else " (client's)",
            extra={"request_id": plan.request_id, "seed": seed, "user": plan.user},
        )
        return handle

    def fail_in_flight(self, error: Callable[[], OpenAIError]) -> int:
        """Fail every request in flight with an `error()` of its own; how many there were."""
        handles = {id(sub.handle): sub.handle for sub in self._subs.values()}
        for handle in handles.values():
            handle.fail(error())
        return len(handles)

    def abort_soon(self, request_ids: list[str], reason: str) -> None:
        task = asyncio.create_task(self._publish_aborts(request_ids, reason))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _publish_aborts(self, request_ids: list[str], reason: str) -> None:
        items = [
            (self.streams.aborts, AbortRequest(request_id=r, reason=reason)) for r in request_ids
        ]
        try:
            await self.bus.publish_many(items)  # type: ignore[arg-type]
            log.info("aborted %s (%s)", ", ".join(request_ids), reason)
        except Exception:
            log.exception("could not publish the abort of %s", ", ".join(request_ids))

    def _release(self, request_id: str) -> None:
        if self._subs.pop(request_id, None) is not None:
            self.released(request_id)
        if not self._subs:
            self._idle.set()

    # --- the reply stream's lifetime ----------------------------------------------------------

    async def refresh_reply_stream(self) -> None:
        """Push the reply stream's expiry `reply_stream_ttl_s` ahead; create it (empty) first
        when it does not exist (before the first reply, or after Redis lost it)."""
        redis = self.bus.redis
        if await redis.expire(self.reply_stream, self.reply_stream_ttl_s):
            return
        with contextlib.suppress(ResponseError):  # BUSYGROUP: a reply created it meanwhile
            await redis.xgroup_create(self.reply_stream, KEEPALIVE_GROUP, id="$", mkstream=True)
        await redis.expire(self.reply_stream, self.reply_stream_ttl_s)

    async def _keep_reply_stream(self) -> None:
        # Ends on `_closing`, not only on cancellation: redis-py can swallow a cancellation
        # that lands inside a command, and the loop would then go on forever.
        while not self._closing.is_set():
            try:
                await self.refresh_reply_stream()
            except Exception as exc:  # Redis away: the next refresh tries again
                log.warning("reply stream TTL not refreshed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.refresh_interval_s)

    # --- replies -----------------------------------------------------------------------------

    async def _read_replies(self, last_ids: dict[str, str]) -> None:
        """Runs for the client's life. The bus retries through Redis outages itself; anything
        else is logged and reading goes on, so one bad reply never stops all the others."""
        while True:
            try:
                deliveries = await self.bus.read(last_ids, count=256, block_ms=READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading the reply stream failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                if isinstance(delivery.message, TokenDelta):
                    for delta in delivery.message.deltas:
                        self._dispatch(delta)
                else:
                    log.warning("unexpected %s on the reply stream", delivery.message.TYPE)

    def _dispatch(self, delta: RequestDelta) -> None:
        sub = self._subs.get(delta.request_id)
        if sub is None:
            return
        try:
            fresh = sub.cursor.fresh(delta)
        except MalformedDelta as exc:
            log.error("malformed reply for %s: %s", delta.request_id, exc)
            sub.cursor.finished = True
            fresh = RequestDelta(
                request_id=delta.request_id,
                start_index=sub.cursor.next_index,
                finish_reason="error",
                error=f"malformed reply from the engine: {exc}",
            )
        if fresh is not None:
            sub.handle.queue.put_nowait((sub.choice, fresh))
        if sub.cursor.finished:
            sub.handle.open.discard(sub.choice)
            self._release(delta.request_id)
