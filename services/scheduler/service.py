"""The scheduler service: the bus edge around the scheduler core.

Tasks, all in one event loop:
- intake (intake.py): SubmitRequests from the shared `requests` stream and the group's own
  (routed by gateways) through the consumer group `schedulers`, read only while the group's
  worker is alive (a group still loading its model takes nothing), acked only when finished;
  claims of a dead scheduler's entries; aborts, and the requests of gateways gone silent;
  poison entries dead-lettered without stopping anything. KVEvents (kv_report.py) and the
  load in each heartbeat (`group_load`) tell gateways where to route.
- worker watch: WorkerReady announcements on the group's `control` stream. A new incarnation
  means the worker restarted empty: every running request is recomputed. Silence longer than
  `worker_timeout_s` means it died (or Redis is away, which looks the same from here): the
  requests are recomputed, and a new plan epoch tells a worker that was only unreachable to
  drop its batch too.
- step loop: schedule -> publish StepPlan -> await the StepResult with the same step id ->
  update -> publish TokenDelta batches -> ack finished requests. A step's TokenDeltas go out
  in the same pipelined round trip as the next plan (one write and one wake-up of Redis a
  step, not two), or alone when no plan follows.

Redis outages: every loop waits for Redis (reads and writes retry however long it is away), so
the scheduler never exits for it; /ready says 503 meanwhile and 200 once Redis and the worker's
announcements are back, and the requests it holds go on from where the core has them.

Prefill/decode disaggregation (services/scheduler/pd, SchedulerSettings.role): a "prefill"
scheduler runs prefill jobs (services/scheduler/pd/edge.py) and acks a request once it handed it
to the `handoff` stream; a "decode" scheduler reads that stream (consumer group `decoders`)
instead of `requests`, and is otherwise a normal scheduler whose offload connector only loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from services.scheduler.config import SchedulerConfig
from services.scheduler.intake import Intake, ReplyExpiry, send
from services.scheduler.kv_report import KVReport
from services.scheduler.offload.edge import OffloadEdge
from services.scheduler.pd.edge import PrefillEdge
from services.scheduler.scheduler import Scheduler
from services.scheduler.scheduler_output import SchedulerOutput
from services.scheduler.spec.metrics import SPEC_METRICS
from services.scheduler.structured_output.grammar_loader import GrammarLoader
from shared.bus import Delivery
from shared.config import SchedulerSettings
from shared.grammar_store import GrammarKeys
from shared.metrics import metric_name
from shared.protocol import (
    KVTransferDone,
    Message,
    StepPlan,
    StepResult,
    TokenDelta,
    WorkerReady,
)
from shared.protocol.health import GroupLoad
from shared.service import Service

log = logging.getLogger(__name__)

NUM_RUNNING = Gauge(metric_name("num_requests_running"), "Requests in the running batch")
NUM_WAITING = Gauge(metric_name("num_requests_waiting"), "Requests waiting to be scheduled")
KV_USAGE = Gauge(metric_name("kv_cache_usage_perc"), "KV cache usage, 0 to 1")
NUM_PREEMPTIONS = Gauge(metric_name("num_preemptions"), "Preemptions since start")
WORKER_RESETS = Counter(
    metric_name("worker_resets"),
    "Times the worker's batch was dropped and every request recomputed (a worker restarted, "
    "declared silent, or a lost step)",
)
PREFIX_HIT_RATE = Gauge(metric_name("prefix_cache_hit_rate"), "Prefix cache hit rate, 0 to 1")
STEP_SECONDS = Histogram(
    metric_name("scheduler_step_seconds"),
    "Wall time of one step seen by the scheduler (plan published -> result applied)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
OVERHEAD_SECONDS = Histogram(
    metric_name("scheduler_overhead_seconds"),
    "Per-step time outside the worker's execute: scheduling, bus hops, updates",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)

METRICS_INTERVAL_S = 0.1  # gauges while stepping; always when the loop goes idle
FIRST = asyncio.FIRST_COMPLETED


@dataclass
class _InFlight:
    """A published plan awaiting its result."""

    plan: StepPlan
    future: asyncio.Future[StepResult | None]
    published_at: float


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, settings: SchedulerSettings) -> None:
        super().__init__(settings)
        self.settings: SchedulerSettings = settings
        self.core: Scheduler | None = None
        self.worker: WorkerReady | None = None
        self.worker_seen_at = 0.0
        self.intake: Intake  # made in start(), with the bus
        self.wakeup = asyncio.Event()
        # Result futures of published plans; a new worker incarnation resolves them with None.
        self.results: dict[int, asyncio.Future[StepResult | None]] = {}
        # What a finished step sends on with the next plan (_publish) or alone (_flush).
        self.outbox: list[tuple[str, TokenDelta]] = []
        self.finished: list[Delivery] = []  # acked after the outbox is out
        self.metrics_at = 0.0
        self.steps_run = 0
        self.epoch = 0  # bumped whenever the worker must drop its batch (_reset_worker)
        # KV offload tier: the kvstore edge (services/scheduler/offload/edge.py), if switched on.
        self.offload: OffloadEdge | None = (
            OffloadEdge(settings, self.wakeup.set) if settings.kv_offload else None
        )
        self.pd: PrefillEdge | None = (
            PrefillEdge(settings, self.offload) if settings.role == "prefill" else None
        )
        self.kv_report = KVReport(
            settings.group, settings.instance_id, self.incarnation, settings.kv_snapshot_interval_s
        )

    def vocab_size(self) -> int:
        """The worker's vocabulary (0 before it announced itself); intake checks ids by it."""
        return self.worker.vocab_size if self.worker else 0

    @property
    def worker_timeout_s(self) -> float:
        return max(5.0, 5 * self.settings.heartbeat_interval_s)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await super().start()
        self.intake = Intake(
            self.bus, self.streams, self.settings, self, self.pd, incarnation=self.incarnation
        )
        self.replies = ReplyExpiry.of(self.streams, self.settings)
        await self.intake.start(GrammarLoader(self.bus.redis, GrammarKeys(self.settings.cluster)))
        if self.offload is not None:
            await self.offload.start(self.bus, self.streams)

    async def run(self) -> None:
        intake, stopping = self.intake, self.stopping
        loops: dict[str, Coroutine[Any, Any, None]] = {
            "intake": intake.read_requests(stopping),
            "aborts": intake.read_aborts(stopping),
            "claims": intake.keep_claims(stopping),
            "gateways": intake.watch_gateways(stopping),
            "worker": self._watch_worker(),
            "results": self._results(),
            "steps": self._step_loop(),
        }
        if self.offload is not None:
            loops["kv-offload"] = self.offload.run(stopping)
        tasks = [asyncio.create_task(coro, name=name) for name, coro in loops.items()]
        stop: asyncio.Task[Any] = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.offload is not None:
            await self.offload.close()
        for task in done:
            if task is not stop and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def drain(self) -> None:
        """Stop admitting (intake stops with `stopping`); unacked requests stay pending in the
        group and are picked up by the restarted or another scheduler."""
        return None

    async def check_ready(self) -> tuple[bool, dict[str, Any]]:
        ready, info = await super().check_ready()
        worker_ok = self.worker_alive()
        info["checks"]["worker"] = "ok" if worker_ok else "no worker announced"
        return ready and worker_ok, info

    def group_load(self) -> GroupLoad | None:
        """Queue depth, running batch and KV usage for the heartbeat (the gateway's router
        and the autoscaling signal). Requests held before a core exists count as waiting."""
        core = self.core
        intake: Intake | None = getattr(self, "intake", None)
        held = len(intake.inflight) if intake else 0
        if core is None:
            return GroupLoad(num_waiting=held, max_num_seqs=self.settings.max_num_seqs)
        return GroupLoad(
            num_waiting=max(held - len(core.running), 0),
            num_running=len(core.running),
            kv_usage=min(max(core.kv.usage, 0.0), 1.0),
            max_num_seqs=core.config.max_num_seqs,
        )

    def state(self) -> dict[str, Any]:
        core = self.core
        intake: Intake | None = getattr(self, "intake", None)  # made in start()
        return {
            **super().state(),
            "worker": self.worker.model_dump() if self.worker else None,
            "worker_alive": self.worker_alive(),
            "scheduler": asdict(core.snapshot()) if core else None,
            "running_request_ids": [r.request_id for r in core.running] if core else [],
            "waiting_request_ids": [r.request_id for r in core.waiting] if core else [],
            "inflight_entries": len(intake.inflight) if intake else 0,
            "orphans_aborted": intake.num_orphans_aborted if intake else 0,
            "kv_offload": self.offload.state() if self.offload else None,
            "role": self.settings.role,
            "prefill": self.pd.state() if self.pd else None,
            "steps_run": self.steps_run,
            "kv_events_sent": self.kv_report.sent,
            "progress": intake.progress.state() if intake else None,
        }

    # --- the worker --------------------------------------------------------------------------

    def worker_alive(self) -> bool:
        return (
            self.worker is not None
            and time.monotonic() - self.worker_seen_at < self.worker_timeout_s
        )

    def requests_added(self) -> None:
        if self.offload is not None:
            self.offload.start_probes()

    async def _watch_worker(self) -> None:
        last = {self.streams.control(self.settings.group): "$"}
        while not self.stopping.is_set():
            for delivery in await self.bus.read(last, count=64, block_ms=1000):
                msg = delivery.message
                if isinstance(msg, WorkerReady):
                    self._on_worker(msg)

    def _on_worker(self, ready: WorkerReady) -> None:
        known = self.worker
        self.worker_seen_at = time.monotonic()
        if known is not None and known.incarnation == ready.incarnation:
            return
        self.worker = ready
        log.info(
            "worker %s (incarnation %s) ready: %d KV blocks of %d tokens, %d state blocks",
            ready.worker_id,
            ready.incarnation,
            ready.num_kv_blocks,
            ready.block_size,
            ready.num_state_blocks,
        )
        config = SchedulerConfig.from_worker(self.settings, ready)
        if self.core is None or self.core.config != config:
            self._rebuild_core(config)
        self._reset_worker(ready.incarnation)
        for future in self.results.values():  # every plan in flight was for the old worker
            if not future.done():
                future.set_result(None)
        self.wakeup.set()

    def _reset_worker(self, incarnation: str) -> None:
        """The core forgets what the worker holds (every request recomputes) and a new epoch
        begins: plans carry it in `scheduler_incarnation`, so a worker that is in fact alive
        with the old batch (it was only silent: a Redis outage) drops that batch too, instead
        of keeping rows the core no longer knows about."""
        assert self.core is not None
        self.core.reset_worker_state(incarnation)
        self.epoch += 1
        WORKER_RESETS.inc()

    def _rebuild_core(self, config: SchedulerConfig) -> None:
        """A first worker, or one of another shape: start a core and (re)queue every request
        we hold. Requests restart from their first token; the gateway drops repeated indexes."""
        if self.core is not None:
            log.warning("worker capacity changed: requests restart on the new KV cache")
        self.core = Scheduler(config, self.settings.instance_id)
        self.epoch += 1  # its step ids start again
        if self.pd is not None:
            self.pd.attach(self.core)
        if self.offload is not None and self.worker is not None:
            self.offload.attach(self.core, self.worker, self.incarnation)
        self.intake.backlog = []
        for submit, delivery in list(self.intake.inflight.values()):
            delta = self.intake.add_to_core(self.core, submit, delivery)
            if delta is not None:  # refused by the new core (e.g. a token id past its vocab)
                self.outbox.append((submit.reply_stream, self.intake.token_delta([delta])))
                self.finished.append(self.intake.forget(submit.request_id)[1])

    async def _results(self) -> None:
        last = {self.streams.results(self.settings.group): "$"}
        while not self.stopping.is_set():
            for delivery in await self.bus.read(last, count=64, block_ms=1000):
                msg = delivery.message
                if isinstance(msg, KVTransferDone):
                    if self.offload is not None and self.core is not None:
                        self.offload.on_done(self.core, msg)
                    continue
                if not isinstance(msg, StepResult):
                    continue
                if self.offload is not None:  # the step's stores are being written now
                    self.offload.on_step_result(msg.step_id)
                future = self.results.pop(msg.step_id, None)
                if future is not None and not future.done():
                    future.set_result(msg)

    # --- the step loop -----------------------------------------------------------------------

    async def _step_loop(self) -> None:
        """Plans go out ahead (async scheduling, settings.schedule_ahead plans at once): step
        N+1 is planned and published while the worker runs step N, which it follows by feeding
        its own sampled tokens forward, so scheduling, the bus hops and the processing of N's
        result hide behind the worker's compute. Steps whose plan depends on the previous
        step's tokens (the core says when: grammars, drafts, routed experts) go one at a
        time."""
        pending: deque[_InFlight] = deque()
        last_result = time.perf_counter()
        while not self.stopping.is_set():
            core = self.core
            if core is None or not self.worker_alive():
                self._abandon(pending)
                await self._flush()
                await self._wait(self.wakeup, 0.5)
                continue
            if self.pd is not None:
                await self._hand_off(core)
            # The depth is asked again before each plan: a request admitted while the last one
            # was published (a grammar, routed experts) can make the core stop pipelining.
            while len(pending) < self._depth(core):
                plan = core.schedule()
                if self.offload is not None:  # probes, load pins, which stores to write
                    await self.offload.prepare(core, plan)
                if plan is None:
                    break
                plan.worker_incarnation = core.worker_incarnation
                plan.scheduler_incarnation = f"{self.incarnation}.{self.epoch}"
                pending.append(await self._publish(plan))
            await self._flush()  # deltas no plan carried (nothing more to schedule now)
            if not pending:
                self._update_metrics(core)
                await self._wait(self.wakeup, 0.5)
                continue
            step = pending.popleft()
            result = await self._await_result(step, pending)
            if result is None:  # worker gone or replaced; its requests were reset
                self._abandon(pending)
                continue
            out = core.update_from_output(step.plan, result)
            if self.pd is not None and result.error is None:
                self.pd.on_step(core, step.plan)
            if result.error is not None:
                # The worker dropped its whole batch after the failure (its state may be
                # half-applied): every request it held is sent again as new, and a plan
                # made ahead of the failure is void.
                self._reset_worker(core.worker_incarnation)
                self._abandon(pending)
            self._finish_step(out)
            self.steps_run += 1
            now = time.perf_counter()
            # The worker's view: from the later of "previous result" and "this plan sent" to
            # this result; what the worker did not spend executing is the mesh's overhead.
            elapsed = now - max(last_result, step.published_at)
            last_result = now
            STEP_SECONDS.observe(elapsed)
            OVERHEAD_SECONDS.observe(max(0.0, elapsed - result.execute_ms / 1000))
            if now - self.metrics_at > METRICS_INTERVAL_S:  # and whenever the loop goes idle
                self.metrics_at = now
                self._update_metrics(core)
        await self._flush()  # stopping: the last step's deltas and acks still go out

    async def _publish(self, plan: StepPlan) -> _InFlight:
        """The plan, with the outbox of the step before it in the same round trip."""
        future: asyncio.Future[StepResult | None] = asyncio.get_running_loop().create_future()
        self.results[plan.step_id] = future  # registered first: a worker change resolves it
        outbox, self.outbox = self.outbox, []
        items: list[tuple[str, Message]] = [*outbox, *self._kv_events()]
        items.append((self.streams.steps(self.settings.group), plan))
        await send(self.bus, items, self.replies)
        await self._ack_finished()
        await self._checkpoint()
        return _InFlight(plan, future, time.perf_counter())

    async def _flush(self) -> None:
        """Send the outbox alone (no plan follows it now)."""
        items: list[tuple[str, Message]] = [*self.outbox, *self._kv_events()]
        self.outbox = []
        if items:
            await send(self.bus, items, self.replies)
        await self._ack_finished()
        await self._checkpoint()

    async def _checkpoint(self) -> None:
        """The progress checkpoints, when due (services/scheduler/progress_edge.py). Only ever
        right after the outbox went out: every output token the core holds was published."""
        await self.intake.progress.sync(self.core, self.intake.inflight, time.monotonic())

    def _kv_events(self) -> list[tuple[str, Message]]:
        """The KVEvents due now (kv_report.py), for gateways' KV-aware routing."""
        core = self.core
        if core is None or self.settings.role != "both":
            return []  # P/D groups take requests from the shared streams, never routed ones
        msg = self.kv_report.due(core.kv.pool, core.config.block_size, time.time())
        return [] if msg is None else [(self.streams.kv_events, msg)]

    async def _ack_finished(self) -> None:
        """Ack finished requests once their last deltas are out (an entry is acked only when
        its request's effect is durable)."""
        if self.finished:
            finished, self.finished = self.finished, []
            await self.bus.ack(self.intake.group, finished)

    def _depth(self, core: Scheduler) -> int:
        """How many plans may be out at once now."""
        if self.settings.async_scheduling and core.can_pipeline():
            return self.settings.schedule_ahead
        return 1

    def _abandon(self, pending: deque[_InFlight]) -> None:
        """Forget plans made ahead whose results no longer matter (the core was reset)."""
        for step in pending:
            self.results.pop(step.plan.step_id, None)
        pending.clear()

    async def _await_result(self, step: _InFlight, later: deque[_InFlight]) -> StepResult | None:
        """The step's result; None when its worker died (silent past the step timeout, or
        gone quiet), was replaced (_on_worker resolves the future with None and has already
        reset the core), or answered a `later` step first (this plan was lost)."""
        plan, future = step.plan, step.future
        deadline = time.monotonic() + self.settings.step_timeout_s
        try:
            while not future.done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.worker_alive():
                    log.error("step %d: worker silent; recomputing its requests", plan.step_id)
                    self._reset_worker("")
                    self.worker = None
                    return None
                if any(s.future.done() for s in later):
                    # The worker answers in step order: a later step's result first means this
                    # plan never reached it (Redis restarted empty between the two writes).
                    log.error("step %d was lost; recomputing its requests", plan.step_id)
                    self._reset_worker(plan.worker_incarnation)
                    return None
                # This step's result or a later one's, whichever comes first.
                waits = [future, *(s.future for s in later)]
                await asyncio.wait(waits, timeout=min(remaining, 1.0), return_when=FIRST)
            result = future.result()
            if result is None or result.worker_incarnation != plan.worker_incarnation:
                return None
            return result
        finally:
            self.results.pop(plan.step_id, None)

    def _finish_step(self, out: SchedulerOutput) -> None:
        """Queue the step's deltas (and the acks of the requests it finished) for the outbox."""
        if out.deltas:
            self.outbox.extend(out.token_deltas(self.settings.instance_id))
        for rid in out.finished_request_ids:
            if rid in self.intake.inflight:
                self.finished.append(self.intake.forget(rid)[1])

    async def _hand_off(self, core: Scheduler) -> None:
        """Prefill role: publish the requests whose prompt KV is stored to the decode side,
        then ack them (their effect is durable once the handoff entry exists)."""
        assert self.pd is not None
        handoffs = self.pd.take_handoffs(core)
        if not handoffs:
            return
        await send(self.bus, [(self.streams.handoff, msg) for msg in handoffs], self.replies)
        held = self.intake.inflight
        acked = [self.intake.forget(m.request_id)[1] for m in handoffs if m.request_id in held]
        await self.bus.ack(self.intake.group, acked)
        log.info("handed off %d requests to decode", len(handoffs))

    @staticmethod
    async def _wait(event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        event.clear()

    @staticmethod
    def _update_metrics(core: Scheduler) -> None:
        SPEC_METRICS.export(core.spec.stats)
        snap = core.snapshot()
        NUM_RUNNING.set(snap.num_running)
        NUM_WAITING.set(snap.num_waiting)
        KV_USAGE.set(snap.kv_usage_percent / 100)
        NUM_PREEMPTIONS.set(snap.num_preemptions)
        PREFIX_HIT_RATE.set(snap.prefix_cache_hit_rate)
