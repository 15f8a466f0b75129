"""The worker's KV offload path end to end inside one runner: a tiny random-weight Llama, the
real connector, transfer threads and a real redis-server.

Blocks stored after a prefill and loaded back into different block ids after the cache was
wiped give the same next logits as the uninterrupted run; a missing key, another model's or
another layout's payload fail the load (and leave the blocks alone); a frozen or stopped Redis
never holds up a step: stores that find staging full are dropped and counted; the store thread
keeps its busy share.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from services.worker.kv_offload.connector import KVConnector
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import LAYOUT_VERSION, PayloadHeader, pack_payload
from services.worker.kv_offload.transfer_engine import TransferEngine
from services.worker.runner.model_runner import ModelRunner
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.protocol import (
    CachedRequestData,
    KVTransfer,
    KVTransferDone,
    NewRequestData,
    SamplingParams,
    StepPlan,
)
from tests.support.plans import new_request
from tests.support.redis_server import RedisServer
from tests.support.tiny_llama import LogitsCapture, make_tiny_llama, tiny_runner

SPACE = KeySpace("test", "tiny-llama", LAYOUT_VERSION)
PROMPT = [1, 17, 99, 4, 250, 31, 8, 77, 300, 12, 5, 40, 61]  # 3 full blocks of 4, then 1 token
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TIMEOUT_S = 30.0


def keys(tag: str, n: int = 3) -> list[str]:
    hashes = [f"{tag}{i}".encode().ljust(16, b".") for i in range(n)]
    return [SPACE.payload_key(OffloadKey(h, 0)) for h in hashes]


class Waiter:
    """Collects KVTransferDone messages; woken by the connector's notify (no polling)."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.done: dict[str, KVTransferDone] = {}
        self.connector: KVConnector | None = None

    def until(self, predicate: object, what: str) -> None:
        assert self.connector is not None
        while not predicate():  # type: ignore[operator]
            assert self.wake.wait(TIMEOUT_S), f"timed out waiting for {what}"
            self.wake.clear()
            self.collect()

    def collect(self) -> None:
        assert self.connector is not None
        for done in self.connector.drain_done():
            assert done.transfer_id not in self.done, "two answers for one transfer"
            self.done[done.transfer_id] = done

    def transfer(self, transfer_id: str) -> KVTransferDone:
        self.until(lambda: transfer_id in self.done, transfer_id)
        return self.done[transfer_id]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-offload")
    make_tiny_llama(path, seed=3)
    return path


def attach(
    runner: ModelRunner,
    url: str,
    staging_bytes: int = 2**20,
    timeout_s: float = TIMEOUT_S,
    max_busy_share: float = 1.0,
) -> Waiter:
    waiter = Waiter()
    engine = TransferEngine(
        url, HostTier(2**20), timeout_s=timeout_s, max_busy_share=max_busy_share
    )
    connector = KVConnector(
        runner.kv_cache,
        engine,
        SPACE,
        worker_id="w1",
        staging_bytes=staging_bytes,
        notify=waiter.wake.set,
    )
    runner.kv_connector = waiter.connector = connector
    return waiter


@pytest.fixture
def offload(tiny_dir: Path, redis_url: str) -> Iterator[tuple[ModelRunner, Waiter]]:
    runner = tiny_runner(tiny_dir)
    waiter = attach(runner, redis_url)
    yield runner, waiter
    assert runner.kv_connector is not None
    runner.kv_connector.close()


def prompt_request(rid: str, blocks: list[int], computed: int = 0) -> NewRequestData:
    return new_request(rid, PROMPT, blocks, computed, GREEDY)


def cached(rid: str, computed: int) -> CachedRequestData:
    return CachedRequestData(request_id=rid, new_block_ids=[[]], num_computed_tokens=computed)


def transfer(tid: str, chunk_keys: list[str], blocks: list[int]) -> KVTransfer:
    return KVTransfer(
        transfer_id=tid,
        request_id="r",
        keys=chunk_keys,
        groups=[0] * len(blocks),
        block_ids=blocks,
    )


def prefill_and_store(runner: ModelRunner, waiter: Waiter, chunk_keys: list[str]) -> None:
    plan = StepPlan(
        step_id=0,
        scheduler_id="s",
        new_requests=[prompt_request("a", [1, 2, 3, 4])],
        num_scheduled_tokens={"a": len(PROMPT)},
        kv_stores=[transfer("store-a", chunk_keys, [1, 2, 3])],
    )
    runner.execute(plan)


def test_blocks_stored_then_loaded_into_other_ids_give_the_same_logits(
    offload: tuple[ModelRunner, Waiter], redis_url: str
) -> None:
    runner, waiter = offload
    capture = LogitsCapture(runner)
    chunk_keys = keys("same")
    prefill_and_store(runner, waiter, chunk_keys)
    stored = waiter.transfer("store-a")
    assert stored.ok and stored.kind == "store" and stored.failed_keys == []
    per_chunk = 3 * runner.kv_cache.layers[0][:, 0].numel() * 4  # 3 layers, fp32
    assert stored.num_bytes > 3 * per_chunk  # bodies plus headers
    assert redis.Redis.from_url(redis_url).exists(*chunk_keys) == 3
    reference = capture.calls[-1][0]  # the prefill's logits at its last position

    for layer in runner.kv_cache.layers:  # the worker lost its cache (as after a restart)
        layer.zero_()
    load = transfer("load-b", chunk_keys, [20, 21, 22])
    runner.execute(
        StepPlan(
            step_id=1,
            scheduler_id="s",
            finished_request_ids=["a"],
            new_requests=[prompt_request("b", [20, 21, 22, 23], computed=12)],
            kv_loads=[load],
        )
    )
    assert runner.kv_connector is not None
    waiter.until(runner.kv_connector.has_ready_loads, "the load's read")
    assert "load-b" not in waiter.done  # read, but not yet in the cache: not reported
    runner.execute(
        StepPlan(
            step_id=2,
            scheduler_id="s",
            cached_requests=[cached("b", 12)],
            num_scheduled_tokens={"b": 1},
        )
    )
    loaded = waiter.transfer("load-b")
    assert loaded.ok and loaded.kind == "load" and loaded.num_bytes == stored.num_bytes
    torch.testing.assert_close(capture.calls[-1][0], reference, rtol=1e-4, atol=1e-4)

    # Without the load, the same step over the wiped blocks gives other logits.
    for layer in runner.kv_cache.layers:
        layer.zero_()
    runner.execute(
        StepPlan(
            step_id=3,
            scheduler_id="s",
            preempted_request_ids=["b"],
            new_requests=[prompt_request("c", [30, 31, 32, 33], computed=12)],
            num_scheduled_tokens={"c": 1},
        )
    )
    assert not torch.allclose(capture.calls[-1][0], reference, rtol=1e-3, atol=1e-3)


def payload_of(model: str = SPACE.model, version: int = LAYOUT_VERSION) -> bytes:
    header = PayloadHeader(model, torch.float32, (3, 2, 4, 2, 16), version)
    return pack_payload(header, torch.ones(header.shape))


@pytest.mark.parametrize(
    ("written", "reason"),
    [
        (None, "missing"),
        (payload_of(model="other-model"), "model mismatch"),
        (payload_of(version=LAYOUT_VERSION + 1), "layout_version mismatch"),
        (payload_of()[:-4], "body has"),
    ],
)
def test_a_bad_chunk_fails_the_whole_load_and_leaves_the_blocks(
    offload: tuple[ModelRunner, Waiter], redis_url: str, written: bytes | None, reason: str
) -> None:
    runner, waiter = offload
    good = payload_of()
    chunk_keys = keys("bad")
    client = redis.Redis.from_url(redis_url)
    client.set(chunk_keys[0], good)
    client.set(chunk_keys[2], good)
    if written is not None:
        client.set(chunk_keys[1], written)
    runner.execute(
        StepPlan(step_id=0, scheduler_id="s", kv_loads=[transfer("l", chunk_keys, [5, 6, 7])])
    )
    done = waiter.transfer("l")
    assert not done.ok and done.failed_keys == [chunk_keys[1]]
    assert done.error is not None and reason in done.error
    assert runner.kv_connector is not None and not runner.kv_connector.has_ready_loads()
    assert all(not layer[:, 5:8].any() for layer in runner.kv_cache.layers)


def test_chunks_this_worker_cannot_place_fail_at_once(offload: tuple[ModelRunner, Waiter]) -> None:
    runner, waiter = offload
    other_space = KeySpace("test", "other-model", LAYOUT_VERSION)
    foreign = other_space.payload_key(OffloadKey(b"x" * 16, 0))
    runner.execute(
        StepPlan(
            step_id=0,
            scheduler_id="s",
            kv_loads=[
                transfer("foreign", [foreign], [5]),
                transfer("block", keys("k", 1), [10_000]),
                KVTransfer(
                    transfer_id="group",
                    request_id="r",
                    keys=keys("g", 1),
                    groups=[1],
                    block_ids=[5],
                ),
            ],
        )
    )
    assert runner.kv_connector is not None
    reasons = [("foreign", "not a payload key"), ("block", "outside"), ("group", "group 1")]
    for tid, reason in reasons:
        done = waiter.done.get(tid) or waiter.transfer(tid)
        assert not done.ok and done.error is not None and reason in done.error, done


def test_reset_drops_a_read_load_before_its_copy(offload: tuple[ModelRunner, Waiter]) -> None:
    runner, waiter = offload
    chunk_keys = keys("reset")
    prefill_and_store(runner, waiter, chunk_keys)
    assert waiter.transfer("store-a").ok
    for layer in runner.kv_cache.layers:
        layer.zero_()
    runner.execute(
        StepPlan(step_id=1, scheduler_id="s", kv_loads=[transfer("l", chunk_keys, [9, 10, 11])])
    )
    connector = runner.kv_connector
    assert connector is not None
    waiter.until(connector.has_ready_loads, "the load's read")
    runner.reset()  # a failed step or a new scheduler incarnation
    done = waiter.transfer("l")
    assert not done.ok and done.error == "worker reset" and done.failed_keys == chunk_keys
    assert connector.apply_ready_loads() == 0
    assert all(not layer[:, 9:12].any() for layer in runner.kv_cache.layers)


def test_idle_worker_applies_a_finished_load(offload: tuple[ModelRunner, Waiter]) -> None:
    runner, waiter = offload
    chunk_keys = keys("idle")
    prefill_and_store(runner, waiter, chunk_keys)
    assert waiter.transfer("store-a").ok
    runner.execute(
        StepPlan(step_id=1, scheduler_id="s", kv_loads=[transfer("l", chunk_keys, [40, 41, 42])])
    )
    connector = runner.kv_connector
    assert connector is not None
    waiter.until(connector.has_ready_loads, "the load's read")
    assert connector.apply_ready_loads() == 1  # what the service does between steps
    assert waiter.transfer("l").ok
    for layer in runner.kv_cache.layers:
        assert torch.equal(layer[:, 40:43], layer[:, 1:4])


def test_stores_never_wait_for_redis(tiny_dir: Path, own_redis: RedisServer) -> None:
    """A frozen Redis (SIGSTOP): the SET cannot be answered, yet steps keep running; once Redis
    thaws the store completes. Then a stopped Redis: the store reports failure."""
    runner = tiny_runner(tiny_dir)
    waiter = attach(runner, own_redis.url)
    connector = runner.kv_connector
    assert connector is not None and own_redis.proc is not None
    chunk_keys = keys("frozen")
    try:
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            prefill_and_store(runner, waiter, chunk_keys)
            for step in range(1, 4):  # decodes run while the store is stuck in Redis
                result = runner.execute(
                    StepPlan(
                        step_id=step,
                        scheduler_id="s",
                        cached_requests=[cached("a", 12 + step)],
                        num_scheduled_tokens={"a": 1},
                    )
                )
                assert len(result.sampled) == 1 and result.error is None
            waiter.collect()
            assert "store-a" not in waiter.done
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        assert waiter.transfer("store-a").ok
        assert redis.Redis.from_url(own_redis.url).exists(*chunk_keys) == 3

        own_redis.stop()
        runner.execute(
            StepPlan(
                step_id=4,
                scheduler_id="s",
                kv_stores=[transfer("store-down", keys("down"), [1, 2, 3])],
            )
        )
        done = waiter.transfer("store-down")
        assert not done.ok and done.failed_keys == keys("down")
        assert "Connection" in (done.error or "")
    finally:
        connector.close()


def test_a_store_larger_than_staging_keeps_its_head_and_drops_the_rest(
    tiny_dir: Path, redis_url: str
) -> None:
    runner = tiny_runner(tiny_dir)
    waiter = attach(runner, redis_url, staging_bytes=1)  # one slot for 3 chunks
    connector = runner.kv_connector
    assert connector is not None and connector.pools[0].num_slots == 1
    try:
        chunk_keys = keys("big")
        prefill_and_store(runner, waiter, chunk_keys)  # returns without waiting for a slot
        done = waiter.transfer("store-a")
        assert not done.ok and done.error == "dropped: staging full"
        assert done.failed_keys == chunk_keys[1:] and connector.dropped_chunks == 2
        assert done.num_bytes == connector.chunk_bytes  # the head chunk was written
        head, *rest = redis.Redis.from_url(redis_url).mget(chunk_keys)
        assert rest == [None, None]
        body = torch.stack([layer[:, 1] for layer in runner.kv_cache.layers])
        assert head == pack_payload(connector.headers[0], body.contiguous())
        assert connector.pools[0].num_free == 1  # given back once written
    finally:
        connector.close()


def test_a_frozen_redis_drops_stores_and_never_slows_the_steps(
    tiny_dir: Path, own_redis: RedisServer
) -> None:
    """Redis frozen (SIGSTOP) with a store stuck in it holding the only staging slots: every
    following step still runs and samples, its stores are dropped at once and counted; after
    the thaw the stuck store completes."""
    runner = tiny_runner(tiny_dir)
    waiter = attach(runner, own_redis.url, staging_bytes=1)  # one slot
    connector = runner.kv_connector
    assert connector is not None and own_redis.proc is not None
    chunk_keys = keys("frozen", 1)
    try:
        own_redis.proc.send_signal(signal.SIGSTOP)
        try:
            runner.execute(
                StepPlan(
                    step_id=0,
                    scheduler_id="s",
                    new_requests=[prompt_request("a", [1, 2, 3, 4])],
                    num_scheduled_tokens={"a": len(PROMPT)},
                    kv_stores=[transfer("stuck", chunk_keys, [1])],
                )
            )
            sampled = 0
            for step in range(1, 4):  # decodes, each offering a store of its own
                result = runner.execute(
                    StepPlan(
                        step_id=step,
                        scheduler_id="s",
                        cached_requests=[cached("a", 12 + step)],
                        num_scheduled_tokens={"a": 1},
                        kv_stores=[transfer(f"drop-{step}", keys(f"d{step}", 2), [2, 3])],
                    )
                )
                assert result.error is None
                sampled += len(result.sampled)
            assert sampled == 3  # every step ran while the store sat in Redis
            waiter.collect()
            assert "stuck" not in waiter.done
            for step in range(1, 4):
                done = waiter.done[f"drop-{step}"]  # answered during its own step
                assert not done.ok and done.error == "dropped: staging full"
            assert connector.dropped_chunks == 6
        finally:
            own_redis.proc.send_signal(signal.SIGCONT)
        assert waiter.transfer("stuck").ok
        assert redis.Redis.from_url(own_redis.url).exists(*chunk_keys) == 1

        own_redis.stop()
        runner.execute(
            StepPlan(
                step_id=4, scheduler_id="s", kv_stores=[transfer("down", keys("down", 1), [1])]
            )
        )
        done = waiter.transfer("down")
        assert not done.ok and done.failed_keys == keys("down", 1)
        assert "Connection" in (done.error or "")
    finally:
        connector.close()


def test_the_store_thread_rests_to_keep_its_busy_share(tiny_dir: Path, redis_url: str) -> None:
    runner = tiny_runner(tiny_dir)
    waiter = attach(runner, redis_url, max_busy_share=0.25)
    connector = runner.kv_connector
    assert connector is not None
    try:
        prefill_and_store(runner, waiter, keys("share"))
        assert waiter.transfer("store-a").ok
        engine = connector.engine
        # 3x the time writing (1 / 0.25 - 1), so writes never take more than a quarter.
        assert engine.busy_s > 0 and engine.rested_s == pytest.approx(3 * engine.busy_s)
    finally:
        connector.close()
