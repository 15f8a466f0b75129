"""Pool bookkeeping invariants checked after every step of a randomized workload with prefix
sharing, chunking, preemption, aborts, failed steps and a worker restart, under each
scheduling policy."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.scheduler.config import SchedulerConfig, SchedulingPolicy
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from shared.protocol import StepResult
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble, token_at

BS = 4


def check_pool(s: Scheduler) -> None:
    pool = s.kv.pool
    holders: Counter[int] = Counter()
    for manager in s.kv.coordinator.managers:
        for blocks in manager.req_to_blocks.values():
            holders.update(b.block_id for b in blocks)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], block
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0), block
    for key, block in pool.cached.items():
        assert block.block_hash == key
    for request in s.running:
        assert request.status is RequestStatus.RUNNING
        held = len(s.kv.get_block_ids(request.request_id)[0])
        assert held == -(-request.num_computed_tokens // BS)
    for request in s.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert s.kv.get_block_ids(request.request_id) == [[]]
    assert set(s.requests) == {r.request_id for r in [*s.running, *s.waiting]}


@pytest.mark.parametrize(("policy", "seed"), [("fcfs", 11), ("priority", 5)])
def test_randomized_workload_keeps_the_pool_consistent(policy: SchedulingPolicy, seed: int) -> None:
    """Chunking, prefix sharing, preemption, aborts, failed steps and a worker restart; under
    the priority policy with mixed priorities and arrivals (victims before and after the
    request that lacks a block), the waiting queue always in (priority, arrival) order."""
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=40,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        scheduling_policy=policy,
    )
    d = Driver(Scheduler(config, "s0"), WorkerDouble(block_size=BS))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 999) for _ in range(n)] for n in (4, 8, 13)]
    prompts: dict[str, int] = {}
    aborted: set[str] = set()
    for step in range(600):
        if step < 400 and rng.random() < 0.3:
            rid = f"r{step}"
            prompt = [*rng.choice(prefixes), *(rng.randrange(10, 999) for _ in range(5))]
            prompts[rid] = len(prompt)
            max_tokens = rng.randrange(1, 40)
            if policy == "fcfs":
                msg = submit(rid, prompt, max_tokens=max_tokens)
            else:
                priority, arrival = rng.randrange(-1, 3), rng.uniform(0, 100)
                msg = submit(rid, prompt, max_tokens, priority=priority, arrival_time=arrival)
            d.scheduler.add_request(msg)
        if rng.random() < 0.03 and d.scheduler.requests:
            rid = rng.choice(sorted(d.scheduler.requests))
            d.scheduler.abort_request(rid)
            aborted.add(rid)
        if step == 300:
            d.scheduler.reset_worker_state("w1")
            d.worker = WorkerDouble(block_size=BS, incarnation="w1")
        plan = d.scheduler.schedule()
        if plan is not None:
            d.plans.append(plan)
            if rng.random() < 0.03:
                result = StepResult(step_id=plan.step_id, worker_id="w", error="flaky")
                d.worker.run(plan)  # it ran, but its result was lost
                out = d.scheduler.update_from_output(plan, result)
            else:
                out = d.scheduler.update_from_output(plan, d.worker.run(plan))
            for stream, deltas in out.deltas.items():
                for delta in deltas:
                    d.client.apply(stream, delta)
        check_pool(d.scheduler)
        if policy == "priority":
            keys = [(r.priority, r.arrival_time, r.arrival_seq) for r in d.scheduler.waiting]
            assert keys == sorted(keys)
    d.run()
    check_pool(d.scheduler)
    assert d.scheduler.kv.num_free_blocks == 39
    assert d.scheduler.num_preemptions > 0 and d.scheduler.num_step_failures > 0
    for rid, n in prompts.items():
        if rid in aborted or d.client.finish.get(rid) == "error":
            continue
        out = d.client.outputs[rid]
        assert out == [token_at(rid, p) for p in range(n, n + len(out))]
        assert d.client.finish[rid] == "length"
