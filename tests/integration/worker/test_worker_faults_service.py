"""The worker service, in-process against a real Redis, when the bus misbehaves: a plan Redis
holds twice (a retried XADD) runs once, and a Redis outage longer than the publish timeout
neither stops the worker nor its announcements."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.worker.service import WorkerService
from shared.bus import Bus
from shared.protocol import StepPlan, StepResult, WorkerReady
from shared.service import bind_socket, serve
from shared.streams import Streams
from tests.integration.worker.service_support import next_message, tiny_worker_settings
from tests.integration.worker.test_overlap_order_service import plans
from tests.support.redis_server import RedisServer
from tests.support.tiny_llama import make_tiny_llama

STREAMS = Streams("wfault")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    make_tiny_llama(path, seed=5)
    return path


async def running_worker(
    tiny: Path, redis_url: str, **overrides: object
) -> tuple[WorkerService, asyncio.Event, asyncio.Task[int]]:
    settings = tiny_worker_settings(
        tiny, redis_url, "wfault", "w-fault", kv_offload=False, **overrides
    )
    service = WorkerService(settings)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=bind_socket("127.0.0.1", 0), shutdown=shutdown))
    return service, shutdown, task


@pytest.fixture
async def bus(redis_url: str) -> AsyncIterator[Bus]:
    bus = Bus(redis_url, "test")
    await bus.connect()
    yield bus
    await bus.close()


def duplicates() -> float:
    return REGISTRY.get_sample_value("meshllm:worker_duplicate_plans_total") or 0.0


def stamped(plan: StepPlan, epoch: str) -> StepPlan:
    plan.scheduler_incarnation = epoch
    return plan


async def test_a_plan_redis_holds_twice_runs_once(tiny: Path, redis_url: str, bus: Bus) -> None:
    _, shutdown, task = await running_worker(tiny, redis_url)
    try:
        ready = await next_message(bus, {STREAMS.control("0"): "0"}, WorkerReady)
        assert isinstance(ready, WorkerReady)
        first, second, third = (stamped(p, "sched.1") for p in plans(ready.incarnation))
        before = duplicates()
        steps = STREAMS.steps("0")
        await bus.publish_many([(steps, first), (steps, second), (steps, second), (steps, third)])
        results = {STREAMS.results("0"): "0"}
        got = [await next_message(bus, results, StepResult) for _ in range(3)]
        assert [r.step_id for r in got] == [0, 1, 2]  # type: ignore[attr-defined]
        assert all(r.error is None for r in got)  # type: ignore[attr-defined]
        assert duplicates() == before + 1

        # A new epoch (the scheduler forgot the batch) starts from step 0 again.
        restart = stamped(plans(ready.incarnation)[0], "sched.2")
        await bus.publish(steps, restart)
        again = await next_message(bus, results, StepResult)
        assert again.step_id == 0 and again.error is None  # type: ignore[attr-defined]
    finally:
        shutdown.set()
        assert await asyncio.wait_for(task, 60) == 0


async def test_an_outage_past_the_publish_timeout_does_not_stop_the_worker(
    tiny: Path, own_redis: RedisServer
) -> None:
    service, shutdown, task = await running_worker(
        tiny, own_redis.url, publish_timeout_s=0.3, redis_timeout_s=0.5
    )
    bus = Bus(own_redis.url, "test")
    try:
        await next_message(bus, {STREAMS.control("0"): "0"}, WorkerReady)
        own_redis.stop()
        await asyncio.sleep(2.0)  # several publish timeouts of the announcer pass
        assert not task.done()
        await asyncio.to_thread(own_redis.start)  # empty
        ready = await next_message(bus, {STREAMS.control("0"): "0"}, WorkerReady)
        assert isinstance(ready, WorkerReady) and ready.incarnation == service.incarnation
        assert not task.done()
    finally:
        shutdown.set()
        assert await asyncio.wait_for(task, 60) == 0
        await bus.close()
