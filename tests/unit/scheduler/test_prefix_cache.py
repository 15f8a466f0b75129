"""Prefix caching through the scheduler: exact blocks reused, the hit cap, salts, no leaks.

The WorkerDouble checks that every prefix-hit block really holds the request's tokens.
"""

from __future__ import annotations

import random

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble

SHARED = [500 + i for i in range(48)]  # exactly 3 blocks of 16


def make(**overrides: object) -> Driver:
    config = SchedulerConfig(
        block_size=16,
        num_gpu_blocks=65,
        max_model_len=512,
        **overrides,  # type: ignore[arg-type]
    )
    return Driver(Scheduler(config, "s0"), WorkerDouble(block_size=16))


def finish_first(d: Driver) -> list[int]:
    """Run request A (shared prefix + tail) to completion; return its block ids."""
    d.scheduler.add_request(submit("a", [*SHARED, 1, 2, 3, 4, 5], max_tokens=4))
    d.run()
    assert d.client.finish["a"] == "length"
    return d.plans[0].new_requests[0].block_ids[0]


def test_shared_three_block_prefix_reuses_exactly_those_blocks() -> None:
    d = make()
    a_blocks = finish_first(d)
    free_before = d.scheduler.kv.num_free_blocks
    d.scheduler.add_request(submit("b", [*SHARED, 9, 9, 9, 9, 9, 9, 9]))
    plan = d.step()
    assert plan is not None
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 48
    assert new.block_ids[0][:3] == a_blocks[:3]
    assert plan.num_scheduled_tokens["b"] == 55 - 48
    # The 3 hit blocks came back from the free queue, plus one new block for the tail.
    assert free_before - d.scheduler.kv.num_free_blocks == 4
    pool = d.scheduler.kv.pool
    assert [pool.blocks[i].ref_cnt for i in a_blocks[:3]] == [1, 1, 1]
    d.run()
    assert d.client.first["b"].num_cached_tokens == 48
    assert d.client.first["b"].num_prompt_tokens == 55


def test_fully_cached_prompt_still_recomputes_its_last_block() -> None:
    d = make()
    a_blocks = finish_first(d)
    d.scheduler.add_request(submit("c", list(SHARED)))
    plan = d.step()
    assert plan is not None
    (new,) = plan.new_requests
    # Hit capped at num_tokens - 1 = 47 tokens, block aligned: 2 blocks.
    assert new.num_computed_tokens == 32
    assert new.block_ids[0][:2] == a_blocks[:2]
    assert new.block_ids[0][2] != a_blocks[2]
    assert plan.num_scheduled_tokens["c"] == 16
    d.run()
    assert d.client.finish["c"] == "length"


def test_cache_salt_prevents_sharing() -> None:
    d = make()
    finish_first(d)
    d.scheduler.add_request(submit("d", [*SHARED, 7], cache_salt="tenant"))
    plan = d.step()
    assert plan is not None and plan.new_requests[0].num_computed_tokens == 0


def test_disabled_prefix_caching_never_hits() -> None:
    d = make(enable_prefix_caching=False)
    finish_first(d)
    d.scheduler.add_request(submit("e", [*SHARED, 7]))
    plan = d.step()
    assert plan is not None and plan.new_requests[0].num_computed_tokens == 0
    assert not d.scheduler.kv.pool.cached


def test_free_blocks_return_to_start_after_100_requests() -> None:
    d = make(max_num_seqs=8, max_num_batched_tokens=64)
    start = d.scheduler.kv.num_free_blocks
    rng = random.Random(7)
    prefixes = [[rng.randrange(10, 999) for _ in range(rng.choice([16, 32, 40]))] for _ in range(4)]
    for i in range(100):
        tail = [rng.randrange(10, 999) for _ in range(rng.randrange(1, 30))]
        prompt = [*rng.choice(prefixes), *tail]
        d.scheduler.add_request(submit(f"r{i}", prompt, max_tokens=rng.randrange(1, 20)))
        if i % 3 == 0:
            d.step()
    d.run()
    assert len(d.client.finish) == 100
    assert d.scheduler.kv.num_free_blocks == start
    assert all(b.ref_cnt == 0 for b in d.scheduler.kv.pool.blocks)
    snap = d.scheduler.snapshot()
    assert snap.prefix_cache_hits > 0 and 0 < snap.prefix_cache_hit_rate < 1
    assert snap.num_running == snap.num_waiting == 0 and snap.kv_usage_percent == 0.0
