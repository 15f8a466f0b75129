"""The scheduler's offload edge against a real kvstore service over the bus: a plan goes out
without waiting for the kvstore (its calls are queued, in order); the stores of a plan start
their short write deadline when the step's result arrives (`on_step_result`), or when the
worker is reset (its steps in flight will never report), never at the `store` call before the
forward. The chunk size offered is the worker's announced one (WorkerReady.kv_chunk_bytes). A
written chunk the kvstore did not take leaves no payload behind. A kvstore that is down costs
one timeout, the plans go out without their stores (recompute), and the edge comes back by
itself once a ping is answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis

from services.scheduler.offload.edge import OffloadEdge
from services.scheduler.scheduler import Scheduler
from shared.bus import Bus
from shared.config import SchedulerSettings
from shared.protocol import KVTransferDone, SampledTokens, StepPlan, StepResult, WorkerReady
from shared.streams import RPC_GROUP
from tests.integration.kvstore.running import (
    CLUSTER,
    MODEL,
    NBYTES,
    SPACE,
    STREAMS,
    RunningKVStore,
    kvstore,
)
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, config

PROMPT = list(range(100, 122))  # 22 tokens: 5 full blocks of 4


async def until(check: Callable[[], Any], what: str) -> None:
    for _ in range(500):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


@asynccontextmanager
async def scheduler_edge(
    redis_url: str, **settings: Any
) -> AsyncIterator[tuple[OffloadEdge, Scheduler]]:
    """A scheduler core with its offload edge, calling the kvstore over a real bus."""
    options: dict[str, Any] = {
        "cluster": CLUSTER,
        "instance_id": "s",
        "kv_offload": True,
        "kv_store_policy": "always",  # one request's blocks are stored (no second sight here)
    }
    edge = OffloadEdge(SchedulerSettings(**{**options, **settings}), lambda: None)
    bus = Bus(redis_url, "s")
    await bus.connect()
    await edge.start(bus, STREAMS)
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
        yield edge, core
    finally:
        stopping.set()
        reports.cancel()
        await edge.close()
        await bus.close()


@asynccontextmanager
async def edge_with_core(
    redis_url: str, capacity_chunks: int = 64
) -> AsyncIterator[tuple[OffloadEdge, Scheduler, RunningKVStore]]:
    async with (
        kvstore(redis_url, capacity_chunks=capacity_chunks) as kv,
        scheduler_edge(redis_url) as (edge, core),
    ):
        yield edge, core, kv


async def plan_with_stores(
    edge: OffloadEdge, core: Scheduler, kv: RunningKVStore | None = None
) -> StepPlan:
    """Schedule (probes answered between tries) until a plan carries stores; with `kv`, also
    until the kvstore has their (queued) `store` call."""
    core.add_request(submit("a", PROMPT, max_tokens=2))
    for _ in range(500):
        plan = core.schedule()
        await edge.prepare(core, plan)
        if plan is not None and plan.kv_stores:
            if kv is not None:
                num = len(plan.kv_stores[0].keys)

                async def offered(num: int = num) -> bool:
                    return (await kv.state())["writing"] == num

                await until(offered, "the kvstore took the store offer")
            return plan
        await asyncio.sleep(0.01)  # the lookup probe answers
    raise AssertionError("no plan with stores")


async def test_a_step_result_starts_the_write_deadline_of_its_stores(redis_url: str) -> None:
    async with edge_with_core(redis_url) as (edge, core, kv):
        plan = await plan_with_stores(edge, core, kv)
        num = len(plan.kv_stores[0].keys)
        assert num == 5
        before = await kv.state()
        assert before["writing"] == num and before["writes_started"] == 0
        assert before["used_bytes"] == num * NBYTES  # the announced chunk size was offered
        edge.on_step_result(plan.step_id - 1)  # an earlier step: not this one's stores
        edge.on_step_result(plan.step_id)

        async def started() -> bool:
            return (await kv.state())["writes_started"] == num

        await until(started, "the kvstore heard the step ended")


async def test_a_worker_reset_starts_the_deadline_of_every_store_in_flight(
    redis_url: str,
) -> None:
    async with edge_with_core(redis_url) as (edge, core, kv):
        plan = await plan_with_stores(edge, core, kv)
        num = len(plan.kv_stores[0].keys)
        core.reset_worker_state("")  # the worker was declared dead: no result will come
        await edge.prepare(core, core.schedule())

        async def started() -> bool:
            return (await kv.state())["writes_started"] == num

        await until(started, "the kvstore heard the steps in flight are void")


async def test_a_dead_kvstore_costs_one_timeout_and_a_ping_brings_the_tier_back(
    redis_url: str,
) -> None:
    bus = Bus(redis_url, "kv-gone")
    await bus.connect()
    await bus.ensure_group(STREAMS.calls("kvstore"), RPC_GROUP)  # it ran once, and died
    await bus.close()
    fast = {"kvstore_timeout_s": 0.3, "kvstore_retry_s": 0.2}
    async with scheduler_edge(redis_url, **fast) as (edge, core):
        core.add_request(submit("a", PROMPT, max_tokens=2))
        plan = None
        while plan is None or not plan.num_scheduled_tokens:  # until the probe timed out
            plan = core.schedule()
            await edge.prepare(core, plan)
            await asyncio.sleep(0.01)
        assert plan.kv_stores == [] and plan.kv_loads == []  # computed; nothing stored
        assert edge.state()["available"] is False and edge.errors == 1
        async with kvstore(redis_url, capacity_chunks=64) as kv:

            async def back() -> bool:
                return edge.usable()  # what every call asks first: pings while down

            await until(back, "a ping reached the restarted kvstore")
            assert edge.client is not None and (await edge.client.stats()).chunks == 0
            assert (await kv.state())["chunks"] == 0
        assert edge.errors == 1  # one failed call for the whole outage: pings are not calls


async def test_a_request_probed_on_arrival_is_admitted_without_deferring(redis_url: str) -> None:
    """The service starts the probes as requests arrive (intake), not only after a schedule():
    once the answer is in, the first schedule() admits the request; without the early probe
    it defers at the head of the queue for a step first."""
    async with edge_with_core(redis_url) as (edge, core, _kv):
        assert core.offload is not None and edge.lookup is not None
        for rid, early, base in (("late", False, 0), ("early", True, 500)):
            core.add_request(submit(rid, [t + base for t in PROMPT], max_tokens=2))
            if early:
                edge.start_probes()

                async def answered() -> bool:
                    assert edge.lookup is not None
                    return edge.lookup.counts()["resolved"] == edge.lookup.counts()["keys"]

                await until(answered, "the arrival probe was answered")
            defers = core.offload.stats.defers
            plan = core.schedule()
            await edge.prepare(core, plan)
            admitted = plan is not None and rid in plan.num_scheduled_tokens
            assert admitted is early
            assert core.offload.stats.defers == defers + (0 if early else 1)
            while not any(r.request_id == rid for r in core.running):  # late: a later step
                await asyncio.sleep(0.01)
                step = core.schedule()
                await edge.prepare(core, step)
                if step is not None:
                    core.update_from_output(step, worker_result(step))


async def test_plans_go_out_while_the_kvstore_does_not_answer(redis_url: str) -> None:
    """A kvstore on the bus that never answers (its group exists, nobody reads it): every plan
    is prepared at once with its stores, the calls wait in the edge's queue."""
    bus = Bus(redis_url, "kv-silent")
    await bus.connect()
    await bus.ensure_group(STREAMS.calls("kvstore"), RPC_GROUP)
    await bus.close()
    async with scheduler_edge(redis_url, kvstore_timeout_s=30.0) as (edge, core):
        core.add_request(submit("a", PROMPT, max_tokens=4))
        prepared = 0
        while prepared < 3:  # the probe is unanswered: admission settles it as a miss
            plan = core.schedule()
            await edge.prepare(core, plan)  # never awaits the kvstore
            if plan is not None:
                core.update_from_output(plan, worker_result(plan))
                prepared += 1
        assert edge.stores_pending("a") and edge.state()["available"] is True
        assert edge.errors == 0  # nothing has even timed out yet


def worker_result(plan: StepPlan) -> StepResult:
    return StepResult(
        step_id=plan.step_id,
        worker_id="w",
        worker_incarnation="w1",
        sampled=[SampledTokens(request_id=rid, token_ids=[7]) for rid in plan.num_scheduled_tokens],
    )


async def test_a_written_chunk_the_kvstore_refused_leaves_no_payload(redis_url: str) -> None:
    """Writes are not held for the kvstore's answer: a chunk the kvstore refused (no room) may
    be written anyway, and its `stored` report makes the kvstore delete it."""
    async with edge_with_core(redis_url, capacity_chunks=2) as (edge, core, kv):
        plan = await plan_with_stores(edge, core)
        (transfer,) = plan.kv_stores
        assert len(transfer.keys) == 5

        async def answered() -> bool:
            return (await kv.state())["writing"] == 2  # room for 2: the others refused

        await until(answered, "the kvstore answered the offer")
        r = aioredis.Redis.from_url(redis_url)
        for key in transfer.keys:  # the worker writes every chunk of its transfer
            await r.set(key, b"\x01" * NBYTES)
        edge.on_step_result(plan.step_id)
        edge.on_done(
            core,
            KVTransferDone(
                worker_id="w",
                worker_incarnation="w1",
                transfer_id=transfer.transfer_id,
                request_id="a",
                kind="store",
                ok=True,
                num_bytes=5 * NBYTES,
            ),
        )

        async def settled() -> bool:
            return not edge.stores_pending("a")

        await until(settled, "the stored report")
        state = await kv.state()
        assert state["chunks"] == 2 and state["writing"] == 0
        assert await r.exists(*transfer.keys) == 2  # the refused three are gone
        metas = [SPACE.meta_key(SPACE.parse(key)) for key in transfer.keys]
        assert await r.exists(*metas) == 2  # and the two kept have their metadata
        await r.aclose()


async def test_a_partly_dropped_store_keeps_the_chunks_it_wrote(redis_url: str) -> None:
    """The worker wrote the head of a store and dropped the rest (staging full): its answer is
    failed, naming the dropped chunks; the written ones are stored, the dropped ones freed."""
    async with edge_with_core(redis_url) as (edge, core, kv):
        plan = await plan_with_stores(edge, core, kv)
        (transfer,) = plan.kv_stores
        head, dropped = transfer.keys[:2], transfer.keys[2:]
        r = aioredis.Redis.from_url(redis_url)
        for key in head:
            await r.set(key, b"\x01" * NBYTES)
        edge.on_step_result(plan.step_id)
        edge.on_done(
            core,
            KVTransferDone(
                worker_id="w",
                worker_incarnation="w1",
                transfer_id=transfer.transfer_id,
                request_id="a",
                kind="store",
                ok=False,
                failed_keys=dropped,
                num_bytes=len(head) * NBYTES,
                error="dropped: staging full",
            ),
        )

        async def settled() -> bool:
            return not edge.stores_pending("a")

        await until(settled, "the stored and failed reports")
        state = await kv.state()
        assert state["chunks"] == len(head) and state["writing"] == 0
        assert await r.exists(*head) == len(head)
        metas = [SPACE.meta_key(SPACE.parse(key)) for key in transfer.keys]
        assert await r.exists(*metas[: len(head)]) == len(head)
        assert await r.exists(*metas[len(head) :]) == 0
        await r.aclose()
