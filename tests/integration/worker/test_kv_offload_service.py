"""The worker service with KV offload on, in-process against a real Redis: a plan's store is
answered with a KVTransferDone on the results stream, and a load finishes (copied into its
blocks, then reported) while the worker idles, with no further plan to carry it. With its
store thread behind (staging full), stores are dropped and counted while every step runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from prometheus_client import REGISTRY

from services.worker.kv_offload.payload import LAYOUT_VERSION
from services.worker.kv_offload.wiring import key_space
from services.worker.service import WorkerService
from shared.bus import Bus
from shared.kv.offload_key import OffloadKey
from shared.protocol import (
    CachedRequestData,
    KVTransfer,
    KVTransferDone,
    Message,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
    WorkerReady,
)
from shared.service import bind_socket, serve
from shared.streams import Streams
from tests.integration.worker.service_support import (
    PROMPT,
    next_message,
    tiny_worker_settings,
)
from tests.support.tiny_llama import make_tiny_llama

STREAMS = Streams("kvsvc")


def transfer(tid: str, keys: list[str], blocks: list[int]) -> KVTransfer:
    return KVTransfer(
        transfer_id=tid, request_id="a", keys=keys, groups=[0] * len(keys), block_ids=blocks
    )


async def test_store_then_idle_load_through_the_service(tmp_path: Path, redis_url: str) -> None:
    make_tiny_llama(tmp_path / "tiny", seed=5)
    settings = tiny_worker_settings(tmp_path / "tiny", redis_url, "kvsvc", "w-kv")
    space = key_space(settings, "tiny")
    assert space.layout_version == LAYOUT_VERSION
    keys = [space.payload_key(OffloadKey(bytes([i]) * 16, 0)) for i in range(3)]
    service = WorkerService(settings)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=bind_socket("127.0.0.1", 0), shutdown=shutdown))
    bus = Bus(redis_url, "test")
    await bus.connect()
    try:
        ready = await next_message(bus, {STREAMS.control("0"): "0"}, WorkerReady)
        assert isinstance(ready, WorkerReady) and ready.model == "tiny"
        results = {STREAMS.results("0"): "0"}
        await bus.publish(
            STREAMS.steps("0"),
            StepPlan(
                step_id=0,
                scheduler_id="s",
                worker_incarnation=ready.incarnation,
                new_requests=[
                    NewRequestData(
                        request_id="a",
                        token_ids=PROMPT,
                        num_prompt_tokens=len(PROMPT),
                        block_ids=[[1, 2, 3, 4]],
                        num_computed_tokens=0,
                        sampling=SamplingParams(temperature=0.0, max_tokens=4),
                    )
                ],
                num_scheduled_tokens={"a": len(PROMPT)},
                kv_stores=[transfer("st", keys, [1, 2, 3])],
            ),
        )
        seen: list[Message] = [await next_message(bus, results, Message) for _ in range(2)]
        assert {type(m) for m in seen} == {StepResult, KVTransferDone}
        stored = next(m for m in seen if isinstance(m, KVTransferDone))
        assert stored.ok and stored.kind == "store" and stored.worker_id == "w-kv"
        assert stored.worker_incarnation == ready.incarnation
        assert stored.num_bytes == 3 * ready.kv_chunk_bytes > 0  # announced size is the real one
        # the host tier keeps a copy of what it wrote, and its gauge says how much
        assert REGISTRY.get_sample_value("meshllm:worker_kv_host_tier_bytes") == stored.num_bytes

        assert service.runner is not None
        layers = service.runner.kv_cache.layers
        original = [layer[:, 1:4].clone() for layer in layers]
        for layer in layers:  # between plans: no step runs
            layer.zero_()
        await bus.publish(
            STREAMS.steps("0"),
            StepPlan(
                step_id=1,
                scheduler_id="s",
                worker_incarnation=ready.incarnation,
                finished_request_ids=["a"],
                kv_loads=[transfer("ld", keys, [30, 31, 32])],
            ),
        )
        loaded = await next_message(bus, results, KVTransferDone)
        assert isinstance(loaded, KVTransferDone) and loaded.transfer_id == "ld" and loaded.ok
        assert loaded.num_bytes == stored.num_bytes
        for layer, before in zip(layers, original, strict=True):
            assert torch.equal(layer[:, 30:33], before)  # copied in before it was reported
        assert service.steps_run == 2  # no plan after the load's: it finished while idle
    finally:
        shutdown.set()
        assert await asyncio.wait_for(task, 60) == 0
        await bus.close()


def dropped_total() -> float:
    return REGISTRY.get_sample_value("meshllm:worker_kv_dropped_stores_total") or 0.0


async def test_a_store_backlog_drops_stores_and_every_step_still_runs(
    tmp_path: Path, redis_url: str
) -> None:
    """One staging slot, and a store thread that rests a million times its writing time: the
    first chunk written leaves the thread resting, the next store waits in the only slot, and
    every later store is dropped at once; the decode steps carrying them are all answered (and
    the shutdown cuts the rest short: the waiting store is written and answered too)."""
    make_tiny_llama(tmp_path / "tiny", seed=5)
    settings = tiny_worker_settings(
        tmp_path / "tiny",
        redis_url,
        "kvdrop",
        "w-drop",
        kv_staging_bytes=1,
        kv_store_max_busy_share=1e-6,
    )
    streams = Streams("kvdrop")
    space = key_space(settings, "tiny")
    service = WorkerService(settings)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=bind_socket("127.0.0.1", 0), shutdown=shutdown))
    bus = Bus(redis_url, "test")
    await bus.connect()
    before = dropped_total()

    def keys(step: int) -> list[str]:
        return [space.payload_key(OffloadKey(bytes([step, i]) * 8, 0)) for i in range(2)]

    try:
        ready = await next_message(bus, {streams.control("0"): "0"}, WorkerReady)
        assert isinstance(ready, WorkerReady)
        results = {streams.results("0"): "0"}
        plans = [
            StepPlan(
                step_id=0,
                scheduler_id="s",
                worker_incarnation=ready.incarnation,
                new_requests=[
                    NewRequestData(
                        request_id="a",
                        token_ids=PROMPT,
                        num_prompt_tokens=len(PROMPT),
                        block_ids=[[1, 2, 3, 4]],
                        num_computed_tokens=0,
                        sampling=SamplingParams(temperature=0.0, max_tokens=4),
                    )
                ],
                num_scheduled_tokens={"a": len(PROMPT)},
                kv_stores=[transfer("st-0", keys(0)[:1], [1])],  # written: the thread rests
            )
        ]
        for step in (1, 2, 3):  # decodes of positions 13..15, each with a store of 2 chunks
            plans.append(
                StepPlan(
                    step_id=step,
                    scheduler_id="s",
                    worker_incarnation=ready.incarnation,
                    cached_requests=[
                        CachedRequestData(
                            request_id="a", new_block_ids=[[]], num_computed_tokens=12 + step
                        )
                    ],
                    num_scheduled_tokens={"a": 1},
                    kv_stores=[transfer(f"st-{step}", keys(step), [1, 2])],
                )
            )
        steps: list[StepResult] = []
        stores: dict[str, KVTransferDone] = {}

        async def until(done: int, stored: set[str]) -> None:
            while len(steps) < done or not stored <= stores.keys():
                msg = await next_message(bus, results, Message)
                if isinstance(msg, StepResult):
                    assert msg.error is None
                    steps.append(msg)
                elif isinstance(msg, KVTransferDone):
                    stores[msg.transfer_id] = msg

        await bus.publish(streams.steps("0"), plans[0])
        await until(1, {"st-0"})  # written: the store thread now rests, its slot free
        assert stores["st-0"].ok
        for step in (1, 2, 3):
            await bus.publish(streams.steps("0"), plans[step])
            await until(step + 1, set())
        await until(4, {"st-2", "st-3"})
        assert [r.step_id for r in steps] == [0, 1, 2, 3]  # every step answered, in order
        # st-1 took the only slot for its head chunk (waiting for the resting thread) and
        # dropped its second; st-2 and st-3 found no slot at all.
        assert "st-1" not in stores
        for tid in ("st-2", "st-3"):
            assert not stores[tid].ok and stores[tid].error == "dropped: staging full"
        assert dropped_total() - before == 5
        shutdown.set()
        assert await asyncio.wait_for(task, 60) == 0
        last = await next_message(bus, results, KVTransferDone)
        assert isinstance(last, KVTransferDone) and last.transfer_id == "st-1"
        assert last.failed_keys == keys(1)[1:] and last.num_bytes == ready.kv_chunk_bytes
    finally:
        shutdown.set()
        assert await asyncio.wait_for(task, 60) == 0
        await bus.close()
