"""Admission estimates equal allocations: on every path, `estimate_blocks_to_allocate` is
exactly the number of blocks `allocate_slots` then takes from the pool's free queue."""

from __future__ import annotations

import random

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.kv_cache_coordinator import KVCacheBlocks
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.kv.kv_cache_spec import FullAttentionSpec, KVCacheGroup
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.protocol import SamplingParams
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble

BS = 16


def manager(num_gpu_blocks: int = 33, groups: int = 1) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BS)
    return KVCacheManager(
        SchedulerConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            kv_cache_groups=[KVCacheGroup(spec=spec) for _ in range(groups)],
        )
    )


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), "replies", BS)


def allocate_checked(
    kv: KVCacheManager,
    req: Request,
    num_new: int,
    hit: KVCacheBlocks | None = None,
    num_hit: int | None = None,
) -> int:
    """Allocate, asserting estimate == blocks taken; returns that number."""
    estimate = kv.estimate_blocks_to_allocate(req, num_new, hit, num_hit)
    before = kv.num_free_blocks
    assert kv.allocate_slots(req, num_new, hit, num_hit) is not None
    assert before - kv.num_free_blocks == estimate
    req.num_computed_tokens += (num_hit or 0) + num_new
    return estimate


def run_and_cache(kv: KVCacheManager, req: Request) -> None:
    """Prefill the whole request, register its full blocks, free it (a finished request)."""
    allocate_checked(kv, req, req.num_tokens)
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.free(req)


def test_fresh_request() -> None:
    kv = manager()
    assert allocate_checked(kv, request("a", list(range(40))), 40) == 3


def test_running_decode_within_and_across_a_block_boundary() -> None:
    kv = manager()
    req = request("a", list(range(47)))
    allocate_checked(kv, req, 47)
    req.append_output_token(7)  # 48 tokens: slot 47 is in block 3 already
    assert allocate_checked(kv, req, 1) == 0
    req.append_output_token(8)  # slot 48 opens block 4
    assert allocate_checked(kv, req, 1) == 1


def test_prefix_hit_on_free_cached_blocks_counts_their_revival() -> None:
    kv = manager()
    prefix = list(range(100, 148))
    run_and_cache(kv, request("a", [*prefix, 1]))
    b = request("b", [*prefix, 2, 3])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 48
    assert allocate_checked(kv, b, b.num_tokens - num_hit, hit, num_hit) == 3 + 1


def test_prefix_hit_on_blocks_held_by_a_running_request_takes_only_new_blocks() -> None:
    kv = manager()
    prefix = list(range(100, 132))
    a = request("a", [*prefix, 1])
    allocate_checked(kv, a, a.num_tokens)
    kv.cache_blocks(a, a.num_computed_tokens)  # a keeps running
    b = request("b", [*prefix, 2, 3, 4])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32 and all(blk.ref_cnt == 1 for blk in hit[0])
    assert allocate_checked(kv, b, b.num_tokens - num_hit, hit, num_hit) == 1
    assert all(blk.ref_cnt == 2 for blk in hit[0])


def test_partial_hit_after_some_cached_blocks_were_evicted() -> None:
    kv = manager(num_gpu_blocks=13)  # 12 usable
    prefix = list(range(100, 164))  # 4 blocks
    run_and_cache(kv, request("a", [*prefix, 1]))  # 5 blocks, freed tail first
    filler = request("f", list(range(5000, 5000 + 9 * BS)))
    allocate_checked(kv, filler, filler.num_tokens)  # 7 never-used blocks, then a's tail two
    kv.free(filler)
    b = request("b", [*prefix, 2])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 48
    assert allocate_checked(kv, b, b.num_tokens - num_hit, hit, num_hit) == 3 + 2


def test_chunked_prefill_chunks() -> None:
    kv = manager()
    req = request("a", list(range(100)))
    taken = [allocate_checked(kv, req, n) for n in (20, 20, 50, 10)]
    assert taken == [2, 1, 3, 1] and sum(taken) == 7


def test_resumed_after_preemption_hits_its_own_blocks() -> None:
    kv = manager()
    req = request("a", list(range(40)))
    allocate_checked(kv, req, 40)
    for t in range(30):
        req.append_output_token(1000 + t)
        allocate_checked(kv, req, 1)
    kv.cache_blocks(req, req.num_computed_tokens)
    kv.free(req)  # preempted
    req.num_computed_tokens = 0
    hit, num_hit = kv.get_computed_blocks(req)
    assert num_hit == 64  # 70 tokens known, 69 computed before: 4 full blocks
    assert allocate_checked(kv, req, req.num_tokens - num_hit, hit, num_hit) == 4 + 1


def test_two_groups_each_take_their_own_blocks() -> None:
    kv = manager(num_gpu_blocks=33, groups=2)
    prefix = list(range(100, 132))
    run_and_cache(kv, request("a", [*prefix, 1]))
    b = request("b", [*prefix, 2, 3])
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 32 and [len(g) for g in hit] == [2, 2]
    assert allocate_checked(kv, b, b.num_tokens - num_hit, hit, num_hit) == 2 * (2 + 1)


def test_refused_allocation_changes_nothing() -> None:
    kv = manager(num_gpu_blocks=5)  # 4 usable
    prefix = list(range(100, 132))
    run_and_cache(kv, request("a", [*prefix, 1]))
    b = request("b", [*prefix, *range(3 * BS)])  # 2 hit + 3 new = 5 > 4
    hit, num_hit = kv.get_computed_blocks(b)
    assert kv.estimate_blocks_to_allocate(b, b.num_tokens - num_hit, hit, num_hit) == 5
    cached = dict(kv.pool.cached)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hit, num_hit) is None
    assert kv.num_free_blocks == 4 and kv.pool.cached == cached
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_long_request_with_a_partial_hit_that_exactly_fits_is_admitted() -> None:
    kv = manager(num_gpu_blocks=10)  # 9 usable
    prefix = list(range(100, 100 + 6 * BS))
    run_and_cache(kv, request("a", [*prefix, 1]))
    b = request("b", [*prefix, *range(3 * BS - 1)])  # 6 hit blocks + 3 new = the whole pool
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 6 * BS
    assert allocate_checked(kv, b, b.num_tokens - num_hit, hit, num_hit) == 9
    assert kv.num_free_blocks == 0


def test_every_allocation_in_a_busy_scheduler_matches_its_estimate() -> None:
    """Spy on the real manager under a workload with prefix hits, chunking and preemption."""
    config = SchedulerConfig(
        block_size=BS, num_gpu_blocks=13, max_num_seqs=6, max_num_batched_tokens=40
    )
    scheduler = Scheduler(config, "s0")
    kv = scheduler.kv
    real = kv.allocate_slots
    seen = {"calls": 0, "refused": 0}

    def checked(req, num_new, hit=None, num_hit=None):  # type: ignore[no-untyped-def]
        estimate = kv.estimate_blocks_to_allocate(req, num_new, hit, num_hit)
        before = kv.num_free_blocks
        result = real(req, num_new, hit, num_hit)
        seen["calls"] += 1
        if result is None:
            seen["refused"] += 1
            assert kv.num_free_blocks == before and estimate > before
        else:
            assert before - kv.num_free_blocks == estimate
        return result

    kv.allocate_slots = checked  # type: ignore[method-assign]
    d = Driver(scheduler, WorkerDouble(block_size=BS))
    rng = random.Random(3)
    shared = [rng.randrange(10, 999) for _ in range(32)]
    for i in range(30):
        prompt = [*shared[: rng.choice([0, 16, 32])], *(rng.randrange(10, 999) for _ in range(9))]
        d.scheduler.add_request(submit(f"r{i}", prompt, max_tokens=rng.randrange(5, 60)))
    d.run()
    assert len(d.client.finish) == 30
    assert seen["refused"] > 0 and scheduler.num_preemptions > 0
    assert kv.stats.hits > 0
