"""The worker service: the bus edge around the ModelRunner.

Plans arrive on the group's `steps` stream, read with plain XREAD from the position recorded
*before* the worker first announces itself, so no plan meant for this incarnation is missed.
Each plan names the incarnation it was made for: plans for an earlier life of this worker (its
KV cache is gone) are dropped; the scheduler sees the new incarnation in WorkerReady and
re-sends its requests to be recomputed. WorkerReady is re-announced every heartbeat interval:
it is the worker's liveness signal for its scheduler and lets a scheduler that starts later
find it. Steps run in a thread so announcements continue during a long prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import torch
from prometheus_client import Counter, Histogram

from services.worker.bootstrap import build_runner
from services.worker.kv_offload.pump import KVTransferPump, attach_kv_offload
from services.worker.model_runner import ModelRunner
from services.worker.models.random_init import is_random_spec, random_source
from services.worker.step_thread import StepThread
from shared.config import WorkerSettings
from shared.metrics import metric_name
from shared.model_source import resolve_model
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
        self._busy = asyncio.Lock()
        self.step_thread = StepThread()  # every forward on one OS thread (step_thread.py)
        self.kv_pump: KVTransferPump | None = None  # KV offload transfers (settings.kv_offload)

    async def start(self) -> None:
        await super().start()
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.num_threads)
        if is_random_spec(self.settings.model):
            source = random_source(self.settings.model, self.settings.served_model_name)
        else:
            source = resolve_model(
                self.settings.model, self.settings.model_cache_dir, self.settings.served_model_name
            )
        self.runner, self.announcement = await self.step_thread.run(
            build_runner, source, self.settings, self.incarnation
        )
        if self.settings.kv_offload:
            self.kv_pump = attach_kv_offload(
                self.settings,
                self.runner.kv_cache,
                self.runner.config,
                self.announcement.model,
                self.incarnation,
                self.bus,
                self.streams.results(self.settings.group),
                self._busy,
                self.step_thread,
            )
            self.runner.kv_connector = self.kv_pump.connector
            self.announcement.kv_chunk_bytes = self.kv_pump.connector.chunk_bytes

    async def run(self) -> None:
        steps = self.streams.steps(self.settings.group)
        last = {steps: "$"}
        await self.bus.read(last, block_ms=None)  # pins "$" before we announce ourselves
        announcer = asyncio.create_task(self._announce(), name="announce")
        tasks = [announcer]
        if self.kv_pump is not None:  # KVTransferDone, and loads applied between steps
            tasks.append(asyncio.create_task(self.kv_pump.run(self.stopping), name="kv-pump"))
        try:
            while not self.stopping.is_set():
                for delivery in await self.bus.read(last, count=16, block_ms=500):
                    if isinstance(delivery.message, StepPlan):
                        await self._execute(delivery.message)
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _announce(self) -> None:
        control = self.streams.control(self.settings.group)
        while not self.stopping.is_set():
            assert self.announcement is not None
            self.announcement.time = time.time()
            await self.bus.publish(control, self.announcement)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _execute(self, plan: StepPlan) -> None:
        runner = self.runner
        assert runner is not None
        if plan.worker_incarnation != self.incarnation:
            STALE_PLANS.inc()
            return
        if plan.scheduler_incarnation != self.scheduler_incarnation:
            if self.scheduler_incarnation:
                log.info("a new scheduler incarnation: dropping the batch of the previous one")
                runner.reset()
            self.scheduler_incarnation = plan.scheduler_incarnation
        async with self._busy:
            t0 = time.perf_counter()
            try:
                result = await self.step_thread.run(runner.execute, plan)
            except Exception as exc:
                log.exception("step %d failed", plan.step_id)
                STEP_FAILURES.inc()
                runner.reset()
                result = StepResult(
                    step_id=plan.step_id,
                    worker_id=self.settings.instance_id,
                    worker_incarnation=self.incarnation,
                    error=f"{type(exc).__name__}: {exc}",
                )
            STEP_EXECUTE.observe(time.perf_counter() - t0)
        await self.bus.publish(self.streams.results(self.settings.group), result)
        self.steps_run += 1

    async def drain(self) -> None:
        async with self._busy:  # let the step in flight finish and reply
            pass
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
        }
