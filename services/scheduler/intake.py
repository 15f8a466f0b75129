"""The scheduler's request side of the bus: the requests it holds, from their entry to its ack.

Requests come from the shared `requests` stream and the group's own one (where gateways route
them, Streams.group_requests) through the consumer group `schedulers` (or, for a decode
scheduler, the `handoff` stream and group `decoders`). Streams of groups that cannot run their
requests are looked after too (peer_groups.py): new entries of a silent or workerless group are
read here, and idle entries of any group are claimed; a scheduler whose worker has been gone
`claim_idle_ms` releases what it holds (`release_all`) so that another group runs it. A request
moves so at most `max_deliveries` times; past that it is failed (submit_check). An entry
delivered before (a claim, or our own pending ones after a restart) continues from its
progress checkpoint (progress_edge.py, resume.py) when its previous runner wrote one.

An entry is acknowledged only when its request finished, so a scheduler that dies leaves its
requests pending: its restart (same consumer name, shared.service.consumer_name) re-reads them
at once with `own_pending`, or another replica claims them once idle. While a request lives
here, its entry is re-claimed to this consumer every few seconds so a long generation is never
mistaken for a dead consumer's.

Poison entries never stop intake. An entry that does not decode is dead-lettered by the bus
(and its client told when the envelope still names it: submit_check.salvage_submit); one that
decodes but is refused (submit_check: a reply stream outside the gateway namespace, a token id
outside the vocabulary, delivered more than `max_deliveries` times) or whose handling raises is
dead-lettered here with the reason, acked, and failed to its client when its reply stream is
usable. The delivery bound is what stops a crash loop: each restart or claim delivers the entry
again, and Redis counts.

Aborts: the fan-out `aborts` stream (every replica sees every abort; unknown ids are kept in a
bounded set in case the abort overtakes its request), and orphans: requests whose gateway
stopped sending heartbeats for `gateway_timeout_s` (gateway_watch.py) are aborted, freeing
their KV for requests somebody still reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from services.scheduler.gateway_watch import GatewayWatch
from services.scheduler.pd.edge import PrefillEdge
from services.scheduler.peer_groups import PeerGroups
from services.scheduler.progress_edge import ProgressEdge
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output.grammar_loader import GrammarLoader, GrammarUnavailable
from services.scheduler.submit_check import (
    Refusal,
    reply_stream_error,
    salvage_submit,
    submit_refusal,
)
from shared.bus import Bus, Delivery, PublishRefused
from shared.bus_entry import Rejected
from shared.config import SchedulerSettings
from shared.protocol import (
    AbortRequest,
    Heartbeat,
    Message,
    ProgressCheckpoint,
    RequestDelta,
    StepPlan,
    SubmitRequest,
    TokenDelta,
)
from shared.streams import DECODE_GROUP, SCHEDULER_GROUP, Streams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)

ABORTED_MEMORY = 10_000  # ids of aborts whose request has not (yet) been seen
CLAIM_REFRESH_S = 2.0
"""How often held entries' idle time is refreshed (and idle ones claimed), at most: a quarter
of `claim_idle_ms` where that is shorter, so a live scheduler's entries never reach the idle
time at which a peer takes them (`claim_refresh_s`)."""
HEARTBEAT_READ_MS = 1000
WORKER_WAIT_S = 0.2  # the requests loop's poll for a live worker


def claim_refresh_s(claim_idle_ms: int) -> float:
    return min(CLAIM_REFRESH_S, claim_idle_ms / 4000)


class Engine(Protocol):
    """What intake needs of the scheduler service's engine side."""

    core: Scheduler | None
    wakeup: asyncio.Event
    outbox: list[tuple[str, TokenDelta]]  # sent with the next plan, or alone

    def vocab_size(self) -> int: ...

    def worker_alive(self) -> bool: ...

    def requests_added(self) -> None:
        """Requests were just added to the core (their offload lookups can start now)."""
        ...


@dataclass
class _Batch:
    """What one read's entries came to: deltas to send, entries to ack, entries to
    dead-letter (and ack) with (reason, detail)."""

    rejected: list[tuple[str, RequestDelta]] = field(default_factory=list)
    done: list[Delivery] = field(default_factory=list)
    failed: list[tuple[Delivery, str, str]] = field(default_factory=list)

    def refuse(self, delivery: Delivery, refusal: Refusal) -> None:
        self.failed.append((delivery, refusal.reason, refusal.detail))
        msg = delivery.message
        if refusal.reply_stream is not None and isinstance(msg, SubmitRequest):
            error = f"the request was refused ({refusal.reason}): {refusal.detail}"
            self.rejected.append((refusal.reply_stream, error_delta(msg.request_id, error)))


class Intake:
    def __init__(
        self,
        bus: Bus,
        streams: Streams,
        settings: SchedulerSettings,
        engine: Engine,
        pd: PrefillEdge | None,
        incarnation: str = "",
    ) -> None:
        self.bus = bus
        self.streams = streams
        self.settings = settings
        self.engine = engine
        self.pd = pd
        # Where requests come from: the gateway's stream, or prefill groups' handoffs.
        decode = settings.role == "decode"
        self.stream = streams.handoff if decode else streams.requests
        self.group = DECODE_GROUP if decode else SCHEDULER_GROUP
        # A group serving requests whole also reads the stream gateways route to it, and looks
        # after the streams of groups that cannot run theirs (peer_groups.py).
        self.routed = settings.role == "both"
        self.own_streams = [self.stream]
        if self.routed:
            self.own_streams.append(streams.group_requests(settings.group))
        self.peers = PeerGroups(settings.group, settings.heartbeat_interval_s)
        self._adopted: set[str] = set()  # peer streams whose consumer group we ensured
        self.worker_gone_since: float | None = None  # monotonic; None while it is alive
        self.num_released = 0
        # request id -> (its submit message, its bus entry), for acks and rebuilds
        self.inflight: dict[str, tuple[SubmitRequest, Delivery]] = {}
        # Compiled grammars of the structured-output requests in `inflight`, loaded at intake.
        self.grammars: dict[str, CompiledGrammar] = {}
        self.grammar_loader: GrammarLoader | None = None
        # Progress checkpoints: written for the requests held, read for entries taken over.
        self.progress = ProgressEdge(bus.redis, streams, settings, incarnation)
        # Requests taken over after a fault (entries delivered before) and their checkpoint
        # (None: none was found), until the core has them (add_to_core).
        self.taken_over: dict[str, ProgressCheckpoint | None] = {}
        self.backlog: list[SubmitRequest] = []  # arrived before any worker announced itself
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.gateways = GatewayWatch(
            settings.gateway_timeout_s,
            streams.replies,
            max_read_gap_s=HEARTBEAT_READ_MS / 1000 + 2 * settings.redis_timeout_s,
            now=time.monotonic(),
        )
        self.num_orphans_aborted = 0

    async def start(self, grammar_loader: GrammarLoader) -> None:
        for stream in self.own_streams:
            await self.bus.ensure_group(stream, self.group)
            self.bus.watch_rejections(stream, self._on_undecodable)
        self.grammar_loader = grammar_loader

    # --- the loops (SchedulerService.run) ----------------------------------------------------

    async def read_requests(self, stopping: asyncio.Event) -> None:
        """Own pending entries first (a restart with the same consumer name), then new ones,
        but only while the group's worker is alive: a scheduler whose worker is still loading
        (a group just added by a scale-up) or restarting leaves new requests in the stream for
        the groups that can run them now, instead of holding them for a model load."""
        own = await self.bus.read_group(self.group, self.own_streams, count=1000, own_pending=True)
        await self.accept(own)
        while not stopping.is_set():
            if not self.engine.worker_alive():
                await asyncio.sleep(WORKER_WAIT_S)
                continue
            deliveries = await self.bus.read_group(
                self.group, self.own_streams, count=256, block_ms=1000
            )
            # Peers' streams without waiting, with the view as it is after the wait: a read
            # left blocking on the stream of a group that was not serving when it began would
            # take the requests routed to it once it serves (a new group's first ones).
            peers = await self._adopt(self.peers.not_serving(time.time()))
            if peers:
                deliveries += await self.bus.read_group(self.group, peers, count=256, block_ms=None)
            await self.accept(deliveries)

    async def _adopt(self, groups: list[str]) -> list[str]:
        """The request streams of `groups` (peers not serving), with our consumer group on
        each (created at the stream's start: entries routed before anyone read it count)."""
        if not self.routed:
            return []
        streams = [self.streams.group_requests(g) for g in groups]
        for stream in streams:
            if stream not in self._adopted:
                await self.bus.ensure_group(stream, self.group)
                self.bus.watch_rejections(stream, self._on_undecodable)
                self._adopted.add(stream)
        return streams

    async def read_aborts(self, stopping: asyncio.Event) -> None:
        last = {self.streams.aborts: "$"}
        while not stopping.is_set():
            for delivery in await self.bus.read(last, count=256, block_ms=1000):
                msg = delivery.message
                if isinstance(msg, AbortRequest):
                    await self.abort(msg.request_id)

    async def keep_claims(self, stopping: asyncio.Event) -> None:
        """Refresh the idle time of entries we hold (so nobody claims a live scheduler's
        requests) and take over entries idle past `claim_idle_ms` (a dead scheduler's)."""
        redis = self.bus.redis
        while not stopping.is_set():
            await asyncio.sleep(claim_refresh_s(self.settings.claim_idle_ms))
            if not self.engine.worker_alive():
                # Our entries age while the worker is gone (no refresh), so a live group
                # claims them once idle past claim_idle_ms; we let go of them then.
                now = time.monotonic()
                if self.worker_gone_since is None:
                    self.worker_gone_since = now
                elif now - self.worker_gone_since >= self.settings.claim_idle_ms / 1000:
                    self.release_all()
                continue
            self.worker_gone_since = None
            by_stream: dict[str, list[Any]] = {}
            for _, delivery in self.inflight.values():
                by_stream.setdefault(delivery.stream, []).append(delivery.entry_id)
            for stream, ids in by_stream.items():
                # JUSTID: refreshing the idle time must not count as another delivery.
                with contextlib.suppress(Exception):
                    await redis.xclaim(stream, self.group, self.bus.consumer, 0, ids, justid=True)
            peers = await self._adopt(self.peers.known(time.time()))
            for stream in [*self.own_streams, *peers]:
                claimed = await self.bus.claim_idle(stream, self.group, self.settings.claim_idle_ms)
                if claimed:
                    log.info("claimed %d abandoned requests from %s", len(claimed), stream)
                    await self.accept(claimed)

    def release_all(self) -> None:
        """Let go of every request held, unacked: the worker has been gone claim_idle_ms, so
        live groups may claim them (from their entries, which record the whole request; the
        gateway drops output indexes it already passed on). Claimed back here if no group
        takes them before our worker returns."""
        if not self.inflight:
            return
        core = self.engine.core
        released = list(self.inflight)
        for request_id in released:
            if core is not None and core.get_request(request_id) is not None:
                core.abort_request(request_id)
            self.forget(request_id, released=True)
        self.backlog = []
        self.num_released += len(released)
        log.warning("worker gone: released %d requests to other groups", len(released))

    async def watch_gateways(self, stopping: asyncio.Event) -> None:
        """Abort the requests whose gateway stopped beating (gateway_watch.py)."""
        last = {self.streams.heartbeats: "$"}
        while not stopping.is_set():
            beats = await self.bus.read(last, count=1024, block_ms=HEARTBEAT_READ_MS)
            now = time.monotonic()
            self.gateways.bus_answered(now)
            for delivery in beats:
                if isinstance(delivery.message, Heartbeat):
                    self.gateways.beat(delivery.message, now)
                    self.peers.beat(delivery.message)
            streams = {submit.reply_stream for submit, _ in self.inflight.values()}
            dead = self.gateways.orphaned(streams, now)
            if not dead:
                continue
            orphans = [rid for rid, (m, _) in self.inflight.items() if m.reply_stream in dead]
            log.warning(
                "aborting %d requests of %d silent gateways", len(orphans), len(dead),
                extra={"reply_streams": sorted(dead)},
            )  # fmt: skip
            for request_id in orphans:
                await self.abort(request_id, orphaned=True)
            self.gateways.forget_older_than(now, 10 * max(self.settings.gateway_timeout_s, 1.0))

    # --- taking entries in -------------------------------------------------------------------

    async def accept(self, deliveries: list[Delivery]) -> None:
        """Take a read's entries in. A refused entry, or one whose handling raises, is
        dead-lettered with the reason and acked, and the others go on."""
        batch = _Batch()
        for delivery in deliveries:
            try:
                await self._accept_one(delivery, batch)
            except Exception as exc:
                log.exception("intake of entry %s failed", delivery.entry_id)
                self._drop_failed(delivery)
                detail = f"{type(exc).__name__}: {exc}"
                batch.refuse(delivery, Refusal("handler_error", detail, self._reply_of(delivery)))
        if batch.rejected:
            await self.publish_deltas(batch.rejected)
        if batch.failed:
            await self.bus.dead_letter(self.group, batch.failed)
        if batch.done:
            await self.bus.ack(self.group, batch.done)
        self.engine.requests_added()
        self.engine.wakeup.set()

    async def _accept_one(self, delivery: Delivery, batch: _Batch) -> None:
        msg = delivery.message
        if not isinstance(msg, SubmitRequest):
            log.warning("unexpected %s on the requests stream", msg.TYPE)
            batch.done.append(delivery)
            return
        if msg.request_id in self.aborted:
            self.aborted.pop(msg.request_id)
            batch.done.append(delivery)
            return
        held = self.inflight.get(msg.request_id)
        if held is not None:
            if held[1].entry_id != delivery.entry_id:
                batch.done.append(delivery)  # a second entry of it (a retried publish)
            return  # else: redelivered while we hold it
        refusal = submit_refusal(
            msg,
            delivery.deliveries,
            streams=self.streams,
            vocab_size=self.engine.vocab_size(),
            max_deliveries=self.settings.max_deliveries,
        )
        if refusal is not None:
            log.error(
                "refused request %s: %s", msg.request_id, refusal.detail,
                extra={"request_id": msg.request_id, "reason": refusal.reason},
            )  # fmt: skip
            batch.refuse(delivery, refusal)
            return
        if self.pd is not None:  # prefill role: the core runs the request's prefill job
            job = self.pd.intake(msg)
            if job is None:  # nothing to prefill here: straight to a decode scheduler
                await self.bus.publish(self.streams.handoff, msg, patient=True)
                batch.done.append(delivery)
                return
            msg = job
        if delivery.deliveries > 1 and self.routed:
            # Delivered before: a dead group's or our own previous process's. It continues
            # from its checkpoint when there is one that fits (resume.py; None when they are
            # off), else from its prompt (counted either way).
            checkpoint = await self.progress.read(delivery)
            if msg.request_id in self.inflight:
                return  # taken by a concurrent intake (a claim) while it read
            if msg.request_id in self.aborted:  # aborted while it read
                self.aborted.pop(msg.request_id)
                batch.done.append(delivery)
                return
            self.taken_over[msg.request_id] = checkpoint
        if msg.grammar is not None:
            error = await self._load_grammar(msg)
            if msg.request_id in self.inflight:
                return  # taken by a concurrent intake (a claim) while it loaded
            if msg.request_id in self.aborted:  # aborted while it loaded
                self.aborted.pop(msg.request_id)
                self.grammars.pop(msg.request_id, None)
                self.taken_over.pop(msg.request_id, None)
                batch.done.append(delivery)
                return
            if error is not None:
                self.taken_over.pop(msg.request_id, None)
                batch.rejected.append((msg.reply_stream, error))
                batch.done.append(delivery)
                return
        self.inflight[msg.request_id] = (msg, delivery)
        core = self.engine.core
        if core is None:
            self.backlog.append(msg)
            return
        delta = self.add_to_core(core, msg, delivery)
        if delta is not None:
            batch.rejected.append((msg.reply_stream, delta))
            batch.done.append(self.forget(msg.request_id)[1])

    def add_to_core(
        self, core: Scheduler, msg: SubmitRequest, delivery: Delivery
    ) -> RequestDelta | None:
        """Queue a held request in the core (Scheduler.add_request): with its grammar, and,
        when it was taken over after a fault, its progress checkpoint."""
        rid = msg.request_id
        taken_over = rid in self.taken_over
        checkpoint = self.taken_over.pop(rid, None)
        delta = core.add_request(msg, self.grammars.get(rid), checkpoint)
        if taken_over and delta is None:
            self.progress.note_added(core, delivery, checkpoint)
        return delta

    async def _load_grammar(self, msg: SubmitRequest) -> RequestDelta | None:
        """Load the request's compiled grammar before the core sees it (the core never waits
        on I/O); an "error" delta when it cannot be loaded."""
        assert msg.grammar is not None and self.grammar_loader is not None
        try:
            self.grammars[msg.request_id] = await self.grammar_loader.load(msg.grammar.key)
        except GrammarUnavailable as exc:
            log.warning("structured output refused: %s", exc, extra={"request_id": msg.request_id})
            return error_delta(msg.request_id, str(exc))
        return None

    def _reply_of(self, delivery: Delivery) -> str | None:
        """The entry's reply stream when the scheduler may write to it."""
        msg = delivery.message
        if not isinstance(msg, SubmitRequest):
            return None
        return None if reply_stream_error(msg.reply_stream, self.streams) else msg.reply_stream

    def _drop_failed(self, delivery: Delivery) -> None:
        """Undo what a failed intake of `delivery` left behind (it may have got anywhere)."""
        msg = delivery.message
        if not isinstance(msg, SubmitRequest):
            return
        held = self.inflight.get(msg.request_id)
        if held is not None and held[1].entry_id == delivery.entry_id:
            core = self.engine.core
            if core is not None and core.get_request(msg.request_id) is not None:
                core.abort_request(msg.request_id)
            self.backlog = [m for m in self.backlog if m.request_id != msg.request_id]
            self.forget(msg.request_id)
        self.grammars.pop(msg.request_id, None)
        self.taken_over.pop(msg.request_id, None)

    def _on_undecodable(self, bad: Rejected) -> None:
        """A submit entry that did not decode was dead-lettered by the bus: tell its client,
        when the envelope still names the request and a usable reply stream."""
        salvaged = salvage_submit(bad.payload)
        if salvaged is None:
            return
        request_id, reply_stream = salvaged
        if reply_stream_error(reply_stream, self.streams) is not None:
            return
        error = f"the request was refused ({bad.reason}): {bad.detail}"
        self.engine.outbox.append(
            (reply_stream, self.token_delta([error_delta(request_id, error)]))
        )
        self.engine.wakeup.set()

    # --- letting requests go -----------------------------------------------------------------

    def forget(self, request_id: str, released: bool = False) -> tuple[SubmitRequest, Delivery]:
        """Drop a request we no longer hold (finished, rejected, aborted; or `released` to
        another group unfinished, which keeps its progress checkpoint)."""
        self.grammars.pop(request_id, None)
        self.taken_over.pop(request_id, None)
        if released:
            self.progress.book.released(request_id)
        else:
            self.progress.book.finished(request_id)
        if self.pd is not None:
            self.pd.forget(request_id)
        return self.inflight.pop(request_id)

    async def abort(self, request_id: str, orphaned: bool = False) -> None:
        """Finish a request with "abort" (its client went away), freeing its KV. `orphaned`:
        its whole gateway is gone, so the final delta goes out only if the reply stream still
        exists (writing must not re-create a dead gateway's expired stream)."""
        entry = self.inflight.get(request_id)
        if entry is None:
            self.aborted[request_id] = None
            while len(self.aborted) > ABORTED_MEMORY:
                self.aborted.popitem(last=False)
            return
        submit, delivery = entry
        core = self.engine.core
        delta = core.abort_request(request_id) if core else None
        if core is None:
            self.backlog = [m for m in self.backlog if m.request_id != request_id]
        if delta is None:
            delta = RequestDelta(request_id=request_id, start_index=0, finish_reason="abort")
        self.forget(request_id)
        if orphaned:
            self.num_orphans_aborted += 1
            delta.error = "the request's gateway stopped sending heartbeats"
            await self.bus.publish_if_exists(submit.reply_stream, self.token_delta([delta]))
        else:
            await self.publish_deltas([(submit.reply_stream, delta)])
        await self.bus.ack(self.group, [delivery])
        reason = " (gateway gone)" if orphaned else ""
        log.info("aborted%s", reason, extra={"request_id": request_id})
        self.engine.wakeup.set()

    # --- writing -----------------------------------------------------------------------------

    def token_delta(self, deltas: list[RequestDelta]) -> TokenDelta:
        return TokenDelta(scheduler_id=self.settings.instance_id, deltas=deltas)

    async def publish_deltas(self, deltas: list[tuple[str, RequestDelta]]) -> None:
        by_stream: dict[str, list[RequestDelta]] = {}
        for stream, delta in deltas:
            by_stream.setdefault(stream, []).append(delta)
        items = [(stream, self.token_delta(d)) for stream, d in by_stream.items()]
        await send(self.bus, items, ReplyExpiry.of(self.streams, self.settings))


def error_delta(request_id: str, error: str) -> RequestDelta:
    return RequestDelta(request_id=request_id, start_index=0, finish_reason="error", error=error)


@dataclass(frozen=True)
class ReplyExpiry:
    """Reply streams (`prefix`...) the scheduler writes get an expiry of `ttl_s` when they
    have none: a gateway that died stops refreshing its stream, the stream expires, and a
    delta still on its way would otherwise re-create it for good."""

    prefix: str
    ttl_s: int

    @classmethod
    def of(cls, streams: Streams, settings: SchedulerSettings) -> ReplyExpiry:
        return cls(streams.replies(""), settings.reply_stream_ttl_s)

    def expiries(self, items: Sequence[tuple[str, Message]]) -> dict[str, int]:
        return {s: self.ttl_s for s, _ in items if s.startswith(self.prefix)}


async def send(bus: Bus, items: Sequence[tuple[str, Message]], replies: ReplyExpiry) -> None:
    """Publish, waiting for Redis however long it is away (nothing the scheduler sends is lost
    by waiting, and no step can run without Redis anyway). An entry Redis refuses is logged and
    dropped, the others are out: intake lets through only reply streams the scheduler may
    write, so a refusal is a deployment error, and one that hits a plan is raised (no step can
    run without it)."""
    try:
        await bus.publish_many(list(items), patient=True, expire_if_unset=replies.expiries(items))
    except PublishRefused as exc:
        for index, error in exc.errors.items():
            stream, msg = items[index]
            log.error("Redis refused a %s for %s: %s", msg.TYPE, stream, error)
            if isinstance(msg, StepPlan):
                raise
