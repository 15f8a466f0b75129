"""The worker service: the bus edge around the ModelRunner.

Plans arrive on the group's `steps` stream, read with plain XREAD from the position recorded
*before* the worker first announces itself, so no plan meant for this incarnation is missed.
Each plan names the incarnation it was made for: plans for an earlier life of this worker (its
KV cache is gone) are dropped; the scheduler sees the new incarnation in WorkerReady and
re-sends its requests to be recomputed. WorkerReady is re-announced every heartbeat interval:
it is the worker's liveness signal for its scheduler and lets a scheduler that starts later
find it. Steps run on one step thread (step_thread.py) so announcements continue during a
long prefill.

Redis outages: the worker waits them out. Results are published patiently (a step's result is
worth waiting for: the scheduler plans from it), the announcer keeps announcing through the
outage (its scheduler stays ready only while it hears it), and a plan that Redis got twice (a
write retried across a broken connection) runs once: plans are dropped unless their step id
grows within one scheduler epoch (`scheduler_incarnation`, which a scheduler changes whenever
it forgets the batch: a restart, or a worker it took for dead while Redis was away).

Overlap (settings.overlap_steps, on for CUDA): with asynchronous scheduling the next plan
arrives while a step still runs on the GPU. It is launched at once, its inputs for the running
step's tokens gathered on the device (in_flight.py); the running step is answered as soon as its
tokens reach the host or the next step has been launched, so the GPU never waits for the
Redis round trip. A plan that arrives after the step in flight has finished on the device
answers that step first, then launches. Results are always published in step order.

Tensor parallelism (settings.tp > 1, services/worker/parallel): this process is rank 0 of the
group and starts the other ranks; every runner call goes to them first (`_group_call`), and a
rank that dies makes `run` fail, so the worker exits and its supervisor restarts the group.
With KV offload on, applying a finished load is a group call too (the pump's, or before a
step's), and stores gather every rank's KV heads inside the step (kv_offload/connector.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import torch
from prometheus_client import Counter, Histogram

from services.worker.attention.select import prebuild_cpu_decode_kernel
from services.worker.cpu_threads import worker_threads
from services.worker.kv_offload.pump import KVTransferPump, attach_kv_offload
from services.worker.kv_offload.wiring import head_shards
from services.worker.models.random_init import is_random_spec, random_source
from services.worker.parallel.group import SINGLE, join_group
from services.worker.parallel.ranks import FollowerRanks, RankDied, free_init_method
from services.worker.runner.bootstrap import build_runner, check_parallel_settings, pick_device
from services.worker.runner.model_runner import LaunchedStep, ModelRunner
from services.worker.runner.step_thread import StepThread
from shared.config import WorkerSettings
from shared.metrics import metric_name
from shared.model.source import resolve_model
from shared.protocol import StepPlan, StepResult, WorkerReady
from shared.service import Service

log = logging.getLogger(__name__)

STEP_EXECUTE = Histogram(
    metric_name("worker_step_execute_seconds"),
    "Time of ModelRunner.execute per step",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
STEP_FAILURES = Counter(metric_name("worker_step_failures_total"), "Steps that raised")
STALE_PLANS = Counter(metric_name("worker_stale_plans_total"), "Plans for another incarnation")
DUPLICATE_PLANS = Counter(
    metric_name("worker_duplicate_plans_total"), "Plans dropped as a second copy of a step"
)
DEVICE_BUSY = Counter(
    metric_name("worker_device_busy_seconds_total"),
    "CUDA: device time of the steps, first queued kernel to last (1 - its rate = the share of "
    "time the GPU waited for a step)",
)


class WorkerService(Service):
    name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.settings: WorkerSettings = settings
        self.runner: ModelRunner | None = None
        self.announcement: WorkerReady | None = None
        self.load_error: str | None = None
        self.steps_run = 0
        self.scheduler_incarnation = ""
        self.last_step_id = -1  # of the current scheduler incarnation: plans run once
        self._busy = asyncio.Lock()
        self.step_thread = StepThread()  # every forward on one OS thread (step_thread.py)
        self._in_flight: LaunchedStep | None = None  # launched, not answered yet
        self._publishing: asyncio.Task[None] | None = None  # the newest result on its way out
        self._overlap = False  # set once the device is known (settings.overlap_steps)
        self.kv_pump: KVTransferPump | None = None  # KV offload transfers (settings.kv_offload)
        self.ranks: FollowerRanks | None = None  # ranks 1..N-1 under tensor parallelism

    async def start(self) -> None:
        await super().start()
        s, device = self.settings, pick_device(self.settings.device)
        if s.num_threads or device.type == "cpu":
            threads = worker_threads(s.num_threads, s.tp)
            torch.set_num_threads(threads)
            log.info("%d torch threads", threads)
        # The CPU decode kernel builds while the model resolves (a first start converts it),
        # both off the event loop: /health answers meanwhile. The build runs on the step
        # thread, idle until the runner is built there, so the worker starts no thread for it.
        kernel = asyncio.create_task(
            self.step_thread.run(prebuild_cpu_decode_kernel, s.cpu_attention, device)
        )
        try:
            if is_random_spec(s.model):
                source = random_source(s.model, s.served_model_name)
            else:
                source = await asyncio.to_thread(
                    resolve_model, s.model, s.model_cache_dir, s.served_model_name
                )
        finally:
            await kernel  # the runner then loads the built library
        tp = SINGLE
        if self.settings.tp > 1:
            check_parallel_settings(self.settings)
            init_method = free_init_method()
            self.ranks = FollowerRanks.start(self.settings, source, self.incarnation, init_method)
            tp = await self.step_thread.run(
                join_group,
                0,
                self.settings.tp,
                init_method,
                device,
                self.settings.tp_timeout_s,
            )
        runner, announcement = await self.step_thread.run(
            build_runner, source, self.settings, self.incarnation, tp
        )
        mode = self.settings.overlap_steps
        self._overlap = mode == "on" or (mode == "auto" and runner.device.type == "cuda")
        if self.settings.kv_offload:
            pump = await attach_kv_offload(
                self.settings,
                runner.kv_cache,
                runner.config,
                announcement.model,
                self.incarnation,
                self.bus,
                self.streams.results(self.settings.group),
                self._busy,
                self.step_thread,
                head_shards(source, tp),
                self.ranks.send if self.ranks is not None else None,
            )
            assert pump.connector is not None
            runner.kv_connector = pump.connector
            announcement.kv_chunk_bytes = pump.connector.chunk_bytes
            self.kv_pump = pump
        self.runner, self.announcement = runner, announcement

    async def run(self) -> None:
        steps = self.streams.steps(self.settings.group)
        last = {steps: "$"}
        await self.bus.read(last, block_ms=None)  # pins "$" before we announce ourselves
        announcer = asyncio.create_task(self._announce(), name="announce")
        tasks = [announcer]
        if self.kv_pump is not None:  # KVTransferDone, and loads applied between steps
            tasks.append(asyncio.create_task(self.kv_pump.run(self.stopping), name="kv-pump"))
        if self.ranks is not None:  # a follower that exits fails run(): the group restarts
            tasks.append(asyncio.create_task(self.ranks.watch(self.stopping), name="ranks"))
        try:
            steps_task = asyncio.create_task(self._step_loop(last), name="steps")
            done, _ = await asyncio.wait(
                {steps_task, *tasks[-1:]} if self.ranks else {steps_task},
                return_when=asyncio.FIRST_EXCEPTION,
            )
            for task in done:
                task.result()  # RankDied, or the step loop's failure
            if not steps_task.done():
                steps_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await steps_task
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _step_loop(self, last: dict[str, str]) -> None:
        """Read plans and run them; with overlap, answer the step in flight as soon as its
        tokens reach the host or the next plan has been launched, whichever comes first."""
        reading: asyncio.Task[list[Any]] | None = None
        landing: tuple[LaunchedStep, asyncio.Task[None]] | None = None
        # A stop ends the wait for plans at once: a read waits out a Redis outage, and with
        # Redis gone (a stack torn down at once) it would hold the exit to the drain's timeout.
        stop = asyncio.create_task(self.stopping.wait(), name="stop")
        try:
            while not self.stopping.is_set():
                if reading is None:
                    reading = asyncio.create_task(self.bus.read(last, count=16, block_ms=500))
                in_flight = self._in_flight
                if in_flight is not None and (landing is None or landing[0] is not in_flight):
                    landing = (in_flight, asyncio.create_task(self._tokens_landed(in_flight)))
                waits: set[asyncio.Task[Any]] = {reading, stop}
                if landing is not None:
                    waits.add(landing[1])
                if reading.done() and landing is None:
                    # the next plans came while the last step ran: no trip through the event
                    # loop's wait (0.3 ms between two steps of a drafting worker on the CPU)
                    done = waits
                else:
                    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if landing is not None and landing[1] in done:
                    if landing[0] is self._in_flight:
                        await self._finish_in_flight()
                    landing = None
                if reading in done:
                    # the next read goes out now: plans that arrive while these run are there
                    # when they are done, without a round trip of their own
                    deliveries = reading.result()
                    reading = asyncio.create_task(self.bus.read(last, count=16, block_ms=500))
                    for delivery in deliveries:
                        if isinstance(delivery.message, StepPlan):
                            await self._execute(delivery.message)
        finally:
            for task in (stop, reading, landing[1] if landing else None):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            await self._finish_in_flight()
            await self._results_out()

    @staticmethod
    async def _tokens_landed(step: LaunchedStep) -> None:
        if step.tokens is not None and not step.tokens.is_ready():
            await asyncio.to_thread(step.tokens.wait)  # not the step thread: it stays free

    async def _announce(self) -> None:
        """WorkerReady every heartbeat interval, for as long as the worker lives: a failed
        announcement (Redis away past the publish timeout) is logged and the next one tried."""
        control = self.streams.control(self.settings.group)
        while not self.stopping.is_set():
            assert self.announcement is not None
            self.announcement.time = time.time()
            try:
                await self.bus.publish(control, self.announcement)
            except Exception as exc:
                log.warning("WorkerReady not announced: %s", exc)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _execute(self, plan: StepPlan) -> None:
        """Launch the plan's step; answer the previous one (results go out in step order);
        answer this one too unless it may stay in flight while the next plan launches."""
        runner = self.runner
        assert runner is not None
        if plan.worker_incarnation != self.incarnation:
            STALE_PLANS.inc()
            return
        if plan.scheduler_incarnation != self.scheduler_incarnation:
            await self._finish_in_flight()
            if self.scheduler_incarnation:
                log.info("a new scheduler incarnation: dropping the batch of the previous one")
                self._reset_runner()
            self.scheduler_incarnation = plan.scheduler_incarnation
        elif plan.step_id <= self.last_step_id:
            log.warning("plan of step %d seen twice; running it once", plan.step_id)
            DUPLICATE_PLANS.inc()
            return
        self.last_step_id = plan.step_id
        if not (self._overlap and runner.can_overlap(plan)):
            await self._finish_in_flight()
            await self._run_step(plan, "execute", publish=True)
            return
        if self._in_flight is not None and self._in_flight.landed():
            # The step in flight is done on the device, so nothing is queued there: answer it
            # first. The scheduler plans the step after this one from that result, so it goes
            # out a launch sooner (launching first kept the plans behind the device every step
            # at large batches); this step starts a finish later, on a device that is idle
            # anyway.
            await self._finish_in_flight()
        launched = await self._run_step(plan, "launch", publish=False)
        await self._finish_in_flight()  # the previous step: results go out in step order
        if launched is not None:
            self._in_flight = launched

    def _group_call(self, op: str, arg: Any) -> Any:
        """Runner call `op(arg)` (launch, execute, finish) on every rank of the group: the
        followers get it first, so they run the step's collectives alongside this one. KV
        loads that finished reading are applied first: in a group, applying is a group call
        of its own (kv_offload/connector.py), never part of a step."""
        if self.ranks is not None:
            if op != "finish" and self.kv_pump is not None and self.kv_pump.connector:
                self.kv_pump.connector.apply_ready_loads()
            self.ranks.send(op, None if op == "finish" else arg)
        return getattr(self.runner, op)(arg)

    def _reset_runner(self) -> None:
        if self.ranks is not None:
            self.ranks.send("reset")
        runner = self.runner
        assert runner is not None
        runner.reset()

    async def _run_step(self, plan: StepPlan, op: str, *, publish: bool) -> Any:
        """Runner call `op(plan)` (execute or launch) on the step thread; a failure resets
        the runner and answers the plan with an error (after any step still in flight)."""
        started = time.perf_counter()
        async with self._busy:
            try:
                out = await self.step_thread.run(self._group_call, op, plan)
            except RankDied:
                raise  # the group is broken: run() fails and the worker restarts
            except Exception as exc:
                log.exception("step %d failed", plan.step_id)
                STEP_FAILURES.inc()
                error = self._error_result(plan.step_id, f"{type(exc).__name__}: {exc}")
                self._reset_runner()
            else:
                if publish:
                    STEP_EXECUTE.observe(time.perf_counter() - started)
                    self._count_device_time()
                    assert isinstance(out, StepResult)
                    await self._publish(out)
                return out
        await self._finish_in_flight()
        await self._publish(error)
        return None

    async def _finish_in_flight(self) -> None:
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        runner = self.runner
        assert runner is not None
        async with self._busy:
            try:
                result = await self.step_thread.run(self._group_call, "finish", step)
            except RankDied:
                raise
            except Exception as exc:
                log.exception("step %d failed", step.step_id)
                STEP_FAILURES.inc()
                self._reset_runner()
                result = self._error_result(step.step_id, f"{type(exc).__name__}: {exc}")
        STEP_EXECUTE.observe(time.perf_counter() - step.started)
        self._count_device_time()
        await self._publish(result)

    def _count_device_time(self) -> None:
        runner = self.runner
        if runner is not None and runner.last_device_seconds:
            DEVICE_BUSY.inc(runner.last_device_seconds)
            runner.last_device_seconds = 0.0

    def _error_result(self, step_id: int, error: str) -> StepResult:
        return StepResult(
            step_id=step_id,
            worker_id=self.settings.instance_id,
            worker_incarnation=self.incarnation,
            error=error,
        )

    async def _publish(self, result: StepResult) -> None:
        """Send a step's result after the ones before it, without holding up the next step
        (a serial step, e.g. one that proposes drafts, would otherwise wait a Redis round trip
        before the next plan runs). A publish that failed fails the step loop here."""
        previous = self._publishing
        if previous is not None and previous.done():
            previous.result()
            previous = None
        self._publishing = asyncio.create_task(self._publish_after(previous, result))

    async def _publish_after(self, previous: asyncio.Task[None] | None, result: StepResult) -> None:
        if previous is not None:
            await previous
        await self.bus.publish(self.streams.results(self.settings.group), result, patient=True)
        self.steps_run += 1

    async def _results_out(self) -> None:
        """Wait until every result handed to `_publish` is out."""
        if self._publishing is not None:
            await self._publishing

    async def drain(self) -> None:
        async with self._busy:  # let the step in flight finish and reply
            pass
        while self._in_flight is not None:  # the step loop answers it on its way out
            await asyncio.sleep(0.005)
        await self._results_out()
        if self.kv_pump is not None:  # finish queued transfers and answer every one
            await self.kv_pump.close()

    async def check_ready(self) -> tuple[bool, dict[str, Any]]:
        ready, info = await super().check_ready()
        loaded = self.runner is not None
        info["checks"]["model"] = "ok" if loaded else "loading"
        return ready and loaded, info

    def state(self) -> dict[str, Any]:
        runner = self.runner
        return {
            **super().state(),
            "model": self.announcement.model_dump() if self.announcement else None,
            "steps_run": self.steps_run,
            "batch_size": runner.batch.num_reqs if runner else 0,
            "tp": self.settings.tp,
            "rank_pids": self.ranks.pids() if self.ranks else {},
        }

    async def close(self) -> None:
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.close)
        await super().close()
