"""HIT_PENDING while serving, against a real kvstore service over the bus on a real Redis.

Two scheduler cores (two worker groups sharing the tier) serve a sliding-window model (window
8, block 4: a hit needs the 2 chunks of its window). Scheduler A computes a prompt; its store
offer reaches the kvstore, so the window chunks read "writing" there, and the worker's answer
is held back (the write is in flight). Scheduler B gets the same prompt: its probe sees
HIT_PENDING in the window it would read, so it is deferred, step after step, computing and
loading nothing. Once the write lands (payloads in Redis, A's `stored`), B loads exactly the
window chunks, ending at the full 5-chunk hit: the tier never held chunks 0-2 (A's store mask
skipped them), and the pending scope was the window only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis

from services.scheduler.config import SchedulerConfig
from services.scheduler.offload.edge import OffloadEdge
from services.scheduler.scheduler import Scheduler
from shared.bus import Bus
from shared.config import SchedulerSettings
from shared.kv.groups import KVGroupSpec
from shared.protocol import KVTransferDone, StepPlan, WorkerReady
from tests.integration.kvstore.running import CLUSTER, MODEL, NBYTES, STREAMS, kvstore
from tests.unit.scheduler.driver import submit

BLOCK = 4
PROMPT = list(range(100, 122))  # 22 tokens: 5 full chunks, the hit cap is 21 -> 5 chunks
READY = WorkerReady(
    worker_id="w", incarnation="w1", model=MODEL, num_kv_blocks=64, block_size=BLOCK,
    vocab_size=1000, max_model_len=200, kv_chunk_bytes=NBYTES,
    kv_groups=[KVGroupSpec(kind="sliding_window", layer_indices=[0, 1], sliding_window=8)],
)  # fmt: skip


@asynccontextmanager
async def group(redis_url: str, instance: str) -> AsyncIterator[tuple[OffloadEdge, Scheduler]]:
    """One scheduler core with its offload edge, as the service wires them."""
    settings = SchedulerSettings(
        cluster=CLUSTER, instance_id=instance, kv_offload=True, kv_store_policy="always",
        kv_pending_write_wait_s=30.0,
    )  # fmt: skip
    edge = OffloadEdge(settings, lambda: None)
    bus = Bus(redis_url, instance)
    await bus.connect()
    await edge.start(bus, STREAMS)
    core = Scheduler(SchedulerConfig.from_worker(settings, READY), instance)
    edge.attach(core, READY, "inc")
    core.reset_worker_state("w1")
    stopping = asyncio.Event()
    calls = asyncio.create_task(edge.run(stopping))
    try:
        yield edge, core
    finally:
        stopping.set()
        calls.cancel()
        await edge.close()
        await bus.close()


async def step(edge: OffloadEdge, core: Scheduler) -> StepPlan | None:
    """One iteration of the service's step loop (the plan is not run: no worker here)."""
    plan = core.schedule()
    await edge.prepare(core, plan)
    return plan


async def until(check: Any, what: str) -> None:
    for _ in range(1000):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_second_group_waits_for_the_window_being_written_then_loads_it(
    redis_url: str,
) -> None:
    r = aioredis.Redis.from_url(redis_url)
    async with (
        kvstore(redis_url, capacity_chunks=64) as kv,
        group(redis_url, "sa") as (edge_a, core_a),
        group(redis_url, "sb") as (edge_b, core_b),
    ):
        core_a.add_request(submit("a", PROMPT, max_tokens=2))
        store_plan = None
        for _ in range(500):
            plan = await step(edge_a, core_a)
            if plan is not None and plan.kv_stores:
                store_plan = plan
                break
            await asyncio.sleep(0.01)  # A's own (cold) probe answers
        assert store_plan is not None
        (store,) = store_plan.kv_stores
        space = edge_a.connector.space  # type: ignore[union-attr]
        hashes = core_a.requests["a"].block_hashes
        window = [space.payload_key(space.parse(k)) for k in store.keys]
        assert [hashes.index(space.parse(k).block_hash) for k in window] == [3, 4]  # store mask

        async def writing() -> bool:
            return (await kv.state())["writing"] == 2

        await until(writing, "the kvstore reserved A's window chunks (writing)")

        core_b.add_request(submit("b", PROMPT, max_tokens=2))
        b = edge_b.connector
        assert b is not None
        for _ in range(3):  # asked again each step while the write is in flight
            edge_b.start_probes()

            async def probed() -> bool:
                return edge_b.lookup is not None and edge_b.lookup.counts()["in_flight"] == 0

            await until(probed, "B's probe answered")
            assert await step(edge_b, core_b) is None  # deferred: no compute, no load
        assert b.stats.pending_defers >= 3 and b.stats.loads_started == 0
        assert core_b.requests["b"].num_computed_tokens == 0

        # The write lands: the worker put the payloads in Redis and answered A's store.
        for name in store.keys:
            await r.set(name, b"\0" * NBYTES)
        edge_a.on_done(
            core_a,
            KVTransferDone(
                worker_id="w", transfer_id=store.transfer_id, request_id="a", kind="store",
                ok=True, num_bytes=2 * NBYTES,
            ),
        )  # fmt: skip

        async def ready() -> bool:
            state = await kv.state()
            return state["writing"] == 0 and state["chunks"] == 2

        await until(ready, "A's chunks are ready")
        load_plan = None
        for _ in range(500):
            edge_b.start_probes()
            load_plan = await step(edge_b, core_b)
            if load_plan is not None:
                break
            await asyncio.sleep(0.01)
        assert load_plan is not None and not load_plan.num_scheduled_tokens
        (load,) = load_plan.kv_loads
        assert load.keys == store.keys  # exactly the window, the 5-chunk hit
        assert b.states["b"].load is not None and b.states["b"].load.num_tokens == 5 * BLOCK
    await r.aclose()
