"""The scheduler service: the bus edge around the scheduler core.

Tasks, all in one event loop:
- intake: SubmitRequests from the shared `requests` stream through the consumer group
  `schedulers` (data-parallel scheduler replicas split them), read only while the group's
  worker is alive (a group still loading its model takes nothing). An entry is acknowledged
  only when its request finished, so a scheduler that dies leaves its requests pending: its
  restart (same consumer name) re-reads them with `own_pending`, or another replica claims
  them once idle.
  While a request lives here, its entry is re-claimed to this consumer every few seconds so a
  long generation is never mistaken for a dead consumer's.
- aborts: the fan-out `aborts` stream (every replica sees every abort; unknown ids are kept in
  a bounded set in case the abort overtakes its request).
- worker watch: WorkerReady announcements on the group's `control` stream. A new incarnation
  means the worker restarted empty: every running request is recomputed. Silence longer than
  `worker_timeout_s` means it died.
- step loop: schedule -> publish StepPlan -> await the StepResult with the same step id ->
  update -> publish TokenDelta batches -> ack finished requests. A step's TokenDeltas go out
  in the same pipelined round trip as the next plan (one write and one wake-up of Redis a
  step, not two), or alone when no plan follows.

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
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge, Histogram

from services.scheduler.config import SchedulerConfig
from services.scheduler.offload.edge import OffloadEdge
from services.scheduler.pd.edge import PrefillEdge
from services.scheduler.scheduler import Scheduler
from services.scheduler.scheduler_output import SchedulerOutput
from services.scheduler.spec.metrics import SPEC_METRICS
from services.scheduler.structured_output.grammar_loader import GrammarLoader, GrammarUnavailable
from shared.bus import Delivery
from shared.config import SchedulerSettings
from shared.grammar_store import GrammarKeys
from shared.metrics import metric_name
from shared.protocol import (
    AbortRequest,
    KVTransferDone,
    RequestDelta,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenDelta,
    WorkerReady,
)
from shared.service import Service
from shared.streams import DECODE_GROUP, SCHEDULER_GROUP

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)

NUM_RUNNING = Gauge(metric_name("num_requests_running"), "Requests in the running batch")
NUM_WAITING = Gauge(metric_name("num_requests_waiting"), "Requests waiting to be scheduled")
KV_USAGE = Gauge(metric_name("kv_cache_usage_perc"), "KV cache usage, 0 to 1")
NUM_PREEMPTIONS = Gauge(metric_name("num_preemptions"), "Preemptions since start")
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

ABORTED_MEMORY = 10_000  # ids of aborts whose request has not (yet) been seen
CLAIM_REFRESH_S = 2.0
WORKER_WAIT_S = 0.2  # intake's poll for a live worker
METRICS_INTERVAL_S = 0.1  # gauges while stepping; always when the loop goes idle


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
        # request id -> (its submit message, its bus entry), for acks and rebuilds
        self.inflight: dict[str, tuple[SubmitRequest, Delivery]] = {}
        # Compiled grammars of the structured-output requests in `inflight`, loaded at intake.
        self.grammars: dict[str, CompiledGrammar] = {}
        self.grammar_loader: GrammarLoader | None = None
        self.backlog: list[SubmitRequest] = []  # arrived before any worker announced itself
        self.aborted: OrderedDict[str, None] = OrderedDict()
        self.wakeup = asyncio.Event()
        # Result futures of published plans; a new worker incarnation resolves them with None.
        self.results: dict[int, asyncio.Future[StepResult | None]] = {}
        # What a finished step sends on with the next plan (_publish) or alone (_flush).
        self.outbox: list[tuple[str, TokenDelta]] = []
        self.finished: list[Delivery] = []  # acked after the outbox is out
        self.metrics_at = 0.0
        self.steps_run = 0
        # KV offload tier: the kvstore edge (services/scheduler/offload/edge.py), if configured.
        self.offload: OffloadEdge | None = (
            OffloadEdge(settings, self.wakeup.set) if settings.kv_offload_enabled else None
        )
        # Where requests come from: the gateway's stream, or prefill groups' handoffs.
        decode = settings.role == "decode"
        self.intake_stream = self.streams.handoff if decode else self.streams.requests
        self.intake_group = DECODE_GROUP if decode else SCHEDULER_GROUP
        self.pd: PrefillEdge | None = (
            PrefillEdge(settings, self.offload) if settings.role == "prefill" else None
        )

    @property
    def worker_timeout_s(self) -> float:
        return max(5.0, 5 * self.settings.heartbeat_interval_s)

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await super().start()
        await self.bus.ensure_group(self.intake_stream, self.intake_group)
        self.grammar_loader = GrammarLoader(self.bus.redis, GrammarKeys(self.settings.cluster))

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(coro, name=coro.__name__)
            for coro in (
                self._intake(),
                self._aborts(),
                self._watch_worker(),
                self._results(),
                self._keep_claims(),
                self._step_loop(),
            )
        ]
        if self.offload is not None:
            tasks.append(asyncio.create_task(self.offload.run(self.stopping), name="kv-offload"))
        stop = asyncio.create_task(self.stopping.wait())
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
        worker_ok = self._worker_alive()
        info["checks"]["worker"] = "ok" if worker_ok else "no worker announced"
        return ready and worker_ok, info

    def state(self) -> dict[str, Any]:
        core = self.core
        return {
            **super().state(),
            "worker": self.worker.model_dump() if self.worker else None,
            "worker_alive": self._worker_alive(),
            "scheduler": asdict(core.snapshot()) if core else None,
            "running_request_ids": [r.request_id for r in core.running] if core else [],
            "waiting_request_ids": [r.request_id for r in core.waiting] if core else [],
            "inflight_entries": len(self.inflight),
            "kv_offload": self.offload.state() if self.offload else None,
            "role": self.settings.role,
            "prefill": self.pd.state() if self.pd else None,
            "steps_run": self.steps_run,
        }

    # --- intake ------------------------------------------------------------------------------

    async def _intake(self) -> None:
        """Own pending entries first (a restart with the same consumer name), then new ones,
        but only while the group's worker is alive: a scheduler whose worker is still loading
        (a group just added by a scale-up) or restarting leaves new requests in the stream for
        the groups that can run them now, instead of holding them for a model load."""
        own = await self.bus.read_group(
            self.intake_group, [self.intake_stream], count=1000, own_pending=True
        )
        await self._accept(own)
        while not self.stopping.is_set():
            if not self._worker_alive():
                await asyncio.sleep(WORKER_WAIT_S)
                continue
            deliveries = await self.bus.read_group(
                self.intake_group, [self.intake_stream], count=256, block_ms=1000
            )
            await self._accept(deliveries)

    async def _accept(self, deliveries: list[Delivery]) -> None:
        rejected: list[tuple[str, RequestDelta]] = []
        done: list[Delivery] = []
        for delivery in deliveries:
            msg = delivery.message
            if not isinstance(msg, SubmitRequest):
                log.warning("unexpected %s on the requests stream", msg.TYPE)
                done.append(delivery)
                continue
            if msg.request_id in self.aborted:
                self.aborted.pop(msg.request_id)
                done.append(delivery)
                continue
            if msg.request_id in self.inflight:
                continue  # redelivered while we hold it
            if self.pd is not None:  # prefill role: the core runs the request's prefill job
                job = self.pd.intake(msg)
                if job is None:  # nothing to prefill here: straight to a decode scheduler
                    await self.bus.publish(self.streams.handoff, msg)
                    done.append(delivery)
                    continue
                msg = job
            if msg.grammar is not None:
                error = await self._load_grammar(msg)
                if msg.request_id in self.inflight:
                    continue  # taken by a concurrent intake (a claim) while it loaded
                if msg.request_id in self.aborted:  # aborted while it loaded
                    self.aborted.pop(msg.request_id)
                    self.grammars.pop(msg.request_id, None)
                    done.append(delivery)
                    continue
                if error is not None:
                    rejected.append((msg.reply_stream, error))
                    done.append(delivery)
                    continue
            self.inflight[msg.request_id] = (msg, delivery)
            if self.core is None:
                self.backlog.append(msg)
                continue
            delta = self.core.add_request(msg, self.grammars.get(msg.request_id))
            if delta is not None:
                rejected.append((msg.reply_stream, delta))
                done.append(self._forget(msg.request_id)[1])
        if rejected:
            await self._publish_deltas(rejected)
        if done:
            await self.bus.ack(self.intake_group, done)
        self.wakeup.set()

    async def _load_grammar(self, msg: SubmitRequest) -> RequestDelta | None:
        """Load the request's compiled grammar before the core sees it (the core never waits
        on I/O); an "error" delta when it cannot be loaded."""
        assert msg.grammar is not None and self.grammar_loader is not None
        try:
            self.grammars[msg.request_id] = await self.grammar_loader.load(msg.grammar.key)
        except GrammarUnavailable as exc:
            log.warning("structured output refused: %s", exc, extra={"request_id": msg.request_id})
            return RequestDelta(
                request_id=msg.request_id, start_index=0, finish_reason="error", error=str(exc)
            )
        return None

    def _forget(self, request_id: str) -> tuple[SubmitRequest, Delivery]:
        """Drop a request we no longer hold (finished, rejected, aborted)."""
        self.grammars.pop(request_id, None)
        if self.pd is not None:
            self.pd.forget(request_id)
        return self.inflight.pop(request_id)

    async def _aborts(self) -> None:
        last = {self.streams.aborts: "$"}
        while not self.stopping.is_set():
            for delivery in await self.bus.read(last, count=256, block_ms=1000):
                msg = delivery.message
                if isinstance(msg, AbortRequest):
                    await self._abort(msg.request_id)

    async def _abort(self, request_id: str) -> None:
        entry = self.inflight.get(request_id)
        if entry is None:
            self.aborted[request_id] = None
            while len(self.aborted) > ABORTED_MEMORY:
                self.aborted.popitem(last=False)
            return
        submit, delivery = entry
        delta = self.core.abort_request(request_id) if self.core else None
        if self.core is None:
            self.backlog = [m for m in self.backlog if m.request_id != request_id]
        if delta is None:
            delta = RequestDelta(request_id=request_id, start_index=0, finish_reason="abort")
        await self._publish_deltas([(submit.reply_stream, delta)])
        self._forget(request_id)
        await self.bus.ack(self.intake_group, [delivery])
        log.info("aborted", extra={"request_id": request_id})
        self.wakeup.set()

    async def _keep_claims(self) -> None:
        """Refresh the idle time of entries we hold (so nobody claims a live scheduler's
        requests) and take over entries idle past `claim_idle_ms` (a dead scheduler's)."""
        redis = self.bus.redis
        while not self.stopping.is_set():
            await asyncio.sleep(CLAIM_REFRESH_S)
            ids = [d.entry_id for _, d in self.inflight.values()]
            if ids:
                with contextlib.suppress(Exception):
                    await redis.xclaim(
                        self.intake_stream,
                        self.intake_group,
                        self.bus.consumer,
                        0,
                        ids,
                        justid=True,
                    )
            if not self._worker_alive():
                continue  # a dead scheduler's requests go to a group that can run them
            claimed = await self.bus.claim_idle(
                self.intake_stream, self.intake_group, self.settings.claim_idle_ms
            )
            if claimed:
                log.info("claimed %d requests of a dead scheduler", len(claimed))
                await self._accept(claimed)

    # --- the worker --------------------------------------------------------------------------

    def _worker_alive(self) -> bool:
        return (
            self.worker is not None
            and time.monotonic() - self.worker_seen_at < self.worker_timeout_s
        )

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
            "worker %s (incarnation %s) ready: %d KV blocks of %d tokens",
            ready.worker_id,
            ready.incarnation,
            ready.num_kv_blocks,
            ready.block_size,
        )
        config = SchedulerConfig.from_worker(self.settings, ready)
        if self.core is None or self.core.config != config:
            self._rebuild_core(config)
        self.core.reset_worker_state(ready.incarnation)  # type: ignore[union-attr]
        for future in self.results.values():  # every plan in flight was for the old worker
            if not future.done():
                future.set_result(None)
        self.wakeup.set()

    def _rebuild_core(self, config: SchedulerConfig) -> None:
        """A first worker, or one of another shape: start a core and (re)queue every request
        we hold. Requests restart from their first token; the gateway drops repeated indexes."""
        if self.core is not None:
            log.warning("worker capacity changed: requests restart on the new KV cache")
        self.core = Scheduler(config, self.settings.instance_id)
        if self.pd is not None:
            self.pd.attach(self.core)
        if self.offload is not None and self.worker is not None:
            self.offload.attach(self.core, self.worker, self.incarnation)
        self.backlog = []
        for submit, _ in list(self.inflight.values()):
            self.core.add_request(submit, self.grammars.get(submit.request_id))

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
            if core is None or not self._worker_alive():
                self._abandon(pending)
                await self._flush()
                await self._wait(self.wakeup, 0.5)
                continue
            if self.pd is not None:
                await self._hand_off(core)
            depth = (
                self.settings.schedule_ahead
                if self.settings.async_scheduling and core.can_pipeline()
                else 1
            )
            while len(pending) < depth:
                plan = core.schedule()
                if self.offload is not None:  # probes, load pins, which stores to write
                    await self.offload.prepare(core, plan)
                if plan is None:
                    break
                plan.worker_incarnation = core.worker_incarnation
                plan.scheduler_incarnation = self.incarnation
                pending.append(await self._publish(plan))
            await self._flush()  # deltas no plan carried (nothing more to schedule now)
            if not pending:
                self._update_metrics(core)
                await self._wait(self.wakeup, 0.5)
                continue
            step = pending.popleft()
            result = await self._await_result(step)
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
                core.reset_worker_state(core.worker_incarnation)
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
        await self.bus.publish_many([*outbox, (self.streams.steps(self.settings.group), plan)])
        await self._ack_finished()
        return _InFlight(plan, future, time.perf_counter())

    async def _flush(self) -> None:
        """Send the outbox alone (no plan follows it now)."""
        if self.outbox:
            outbox, self.outbox = self.outbox, []
            await self.bus.publish_many(list(outbox))
        await self._ack_finished()

    async def _ack_finished(self) -> None:
        """Ack finished requests once their last deltas are out (an entry is acked only when
        its request's effect is durable)."""
        if self.finished:
            finished, self.finished = self.finished, []
            await self.bus.ack(self.intake_group, finished)

    def _abandon(self, pending: deque[_InFlight]) -> None:
        """Forget plans made ahead whose results no longer matter (the core was reset)."""
        for step in pending:
            self.results.pop(step.plan.step_id, None)
        pending.clear()

    async def _await_result(self, step: _InFlight) -> StepResult | None:
        """The step's result; None when its worker died (silent past the step timeout, or
        gone quiet) or was replaced (_on_worker resolves the future with None and has already
        reset the core)."""
        plan, future = step.plan, step.future
        deadline = time.monotonic() + self.settings.step_timeout_s
        try:
            while not future.done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._worker_alive():
                    log.error("step %d: worker silent; recomputing its requests", plan.step_id)
                    self.core.reset_worker_state("")  # type: ignore[union-attr]
                    self.worker = None
                    return None
                await asyncio.wait([future], timeout=min(remaining, 1.0))
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
            if rid in self.inflight:
                self.finished.append(self._forget(rid)[1])

    async def _hand_off(self, core: Scheduler) -> None:
        """Prefill role: publish the requests whose prompt KV is stored to the decode side,
        then ack them (their effect is durable once the handoff entry exists)."""
        assert self.pd is not None
        handoffs = self.pd.take_handoffs(core)
        if not handoffs:
            return
        await self.bus.publish_many([(self.streams.handoff, msg) for msg in handoffs])
        acked = [self._forget(m.request_id)[1] for m in handoffs if m.request_id in self.inflight]
        await self.bus.ack(self.intake_group, acked)
        log.info("handed off %d requests to decode", len(handoffs))

    async def _publish_deltas(self, deltas: list[tuple[str, RequestDelta]]) -> None:
        by_stream: dict[str, list[RequestDelta]] = {}
        for stream, delta in deltas:
            by_stream.setdefault(stream, []).append(delta)
        await self.bus.publish_many(
            [
                (stream, TokenDelta(scheduler_id=self.settings.instance_id, deltas=items))
                for stream, items in by_stream.items()
            ]
        )

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
