"""The scheduler's offload edge against a real kvstore service: the stores of a plan start their
short write deadline when the step's result arrives (`on_step_result`), or when the worker is
reset (its steps in flight will never report), never at the `store` call before the forward.
The chunk size offered is the worker's announced one (WorkerReady.kv_chunk_bytes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from services.scheduler.offload.edge import OffloadEdge
from services.scheduler.offload.kvstore_client import KVStoreClient
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerSettings
from shared.protocol import StepPlan, WorkerReady
from tests.integration.kvstore.running import CLUSTER, MODEL, NBYTES, kvstore
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, config

PROMPT = list(range(100, 122))  # 22 tokens: 5 full blocks of 4


async def state(http: httpx.AsyncClient) -> dict[str, Any]:
    return dict((await http.get("/admin/state")).json()["kvstore"])


async def until(check: Callable[[], Any], what: str) -> None:
    for _ in range(500):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@asynccontextmanager
async def edge_with_core(redis_url: str) -> AsyncIterator[tuple[OffloadEdge, Scheduler, Any]]:
    async with kvstore(redis_url, capacity_chunks=64) as http:
        settings = SchedulerSettings(cluster=CLUSTER, instance_id="s", kvstore_url="http://kv")
        edge = OffloadEdge(
            settings, lambda: None, lambda model: KVStoreClient("", model, http=http)
        )
        core = Scheduler(config(), "s")
        ready = WorkerReady(
            worker_id="w",
            incarnation="w1",
            model=MODEL,
            num_kv_blocks=64,
            block_size=BLOCK,
            vocab_size=1000,
            max_model_len=200,
            kv_chunk_bytes=NBYTES,
        )
        edge.attach(core, ready, "inc")
        core.reset_worker_state("w1")  # what the service does when the worker is ready
        stopping = asyncio.Event()
        reports = asyncio.create_task(edge.run(stopping))
        try:
            yield edge, core, http
        finally:
            stopping.set()
            reports.cancel()
            await edge.close()


async def plan_with_stores(edge: OffloadEdge, core: Scheduler) -> StepPlan:
    """Schedule (probes answered between tries) until a plan carries stores the kvstore took."""
    core.add_request(submit("a", PROMPT, max_tokens=2))
    for _ in range(500):
        plan = core.schedule()
        await edge.prepare(core, plan)
        if plan is not None and plan.kv_stores:
            return plan
        await asyncio.sleep(0.01)  # the lookup probe answers
    raise AssertionError("no plan with stores")


async def test_a_step_result_starts_the_write_deadline_of_its_stores(redis_url: str) -> None:
    async with edge_with_core(redis_url) as (edge, core, http):
        plan = await plan_with_stores(edge, core)
        num = len(plan.kv_stores[0].keys)
        assert num == 5
        before = await state(http)
        assert before["writing"] == num and before["writes_started"] == 0
        assert before["used_bytes"] == num * NBYTES  # the announced chunk size was offered
        edge.on_step_result(plan.step_id - 1)  # an earlier step: not this one's stores
        edge.on_step_result(plan.step_id)

        async def started() -> bool:
            return (await state(http))["writes_started"] == num

        await until(started, "the kvstore heard the step ended")


async def test_a_worker_reset_starts_the_deadline_of_every_store_in_flight(
    redis_url: str,
) -> None:
    async with edge_with_core(redis_url) as (edge, core, http):
        plan = await plan_with_stores(edge, core)
        num = len(plan.kv_stores[0].keys)
        core.reset_worker_state("")  # the worker was declared dead: no result will come
        await edge.prepare(core, core.schedule())

        async def started() -> bool:
            return (await state(http))["writes_started"] == num

        await until(started, "the kvstore heard the steps in flight are void")
