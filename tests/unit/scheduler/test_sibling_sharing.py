"""n > 1: sibling requests admitted in one step share their prompt's KV blocks.

The scheduler registers a block in the prefix cache when it allocates it for the step that
fills it, so the 2nd..nth sibling of a step hit the 1st's prompt blocks instead of computing
the prompt n times. The WorkerDouble reads prefix-hit blocks only after the whole step's
writes (as the real worker's attention does) and fails the test if a hit block does not hold
the request's tokens. A failed step must leave no hash on a block it was to write.
"""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.protocol import StepResult
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble, token_at

BS = 16
PROMPT = [300 + i for i in range(40)]  # 2 full blocks + 8 tokens


def make(**overrides: object) -> Driver:
    fields: dict[str, object] = {"block_size": BS, "num_gpu_blocks": 65, "max_model_len": 256}
    fields.update(overrides)
    return Driver(Scheduler(SchedulerConfig(**fields), "s0"), WorkerDouble(block_size=BS))  # type: ignore[arg-type]


def add_siblings(d: Driver, prompt: list[int], n: int = 4, max_tokens: int = 6) -> list[str]:
    ids = [f"c{k}" for k in range(n)]
    for k, rid in enumerate(ids):
        d.scheduler.add_request(submit(rid, prompt, max_tokens=max_tokens, seed=100 + k))
    return ids


def test_four_siblings_in_one_step_hold_the_prompt_blocks_once() -> None:
    d = make()
    free_before = d.scheduler.kv.num_free_blocks
    ids = add_siblings(d, PROMPT)
    plan = d.step()
    assert plan is not None
    new = {r.request_id: r for r in plan.new_requests}
    assert list(new) == ids  # all four admitted in the same step
    first = new["c0"].block_ids[0]
    assert new["c0"].num_computed_tokens == 0 and plan.num_scheduled_tokens["c0"] == 40
    for rid in ids[1:]:
        assert new[rid].num_computed_tokens == 2 * BS
        assert new[rid].block_ids[0][:2] == first[:2]
        assert plan.num_scheduled_tokens[rid] == 40 - 2 * BS
    # 3 blocks for the first, then one (the partial last block) for each sibling: 6, not 12.
    assert free_before - d.scheduler.kv.num_free_blocks == 3 + 3
    pool = d.scheduler.kv.pool
    assert [pool.blocks[b].ref_cnt for b in first[:2]] == [4, 4]
    d.run()
    for rid in ids:
        assert d.client.outputs[rid] == [token_at(rid, p) for p in range(40, 46)]
        assert d.client.first[rid].num_cached_tokens == (0 if rid == "c0" else 2 * BS)
    assert d.scheduler.kv.num_free_blocks == free_before
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_block_aligned_prompt_siblings_still_recompute_the_last_block() -> None:
    d = make()
    prompt = PROMPT[:32] + [7] * 16  # exactly 3 blocks
    add_siblings(d, prompt, n=2)
    plan = d.step()
    assert plan is not None
    first, second = plan.new_requests
    # The hit is capped at num_tokens - 1 = 47: two blocks, the third is recomputed.
    assert second.num_computed_tokens == 2 * BS
    assert second.block_ids[0][:2] == first.block_ids[0][:2]
    assert second.block_ids[0][2] != first.block_ids[0][2]
    d.run()
    assert set(d.client.finish.values()) == {"length"}


def test_a_request_admitted_behind_a_prefill_chunk_hits_the_block_that_chunk_fills() -> None:
    d = make(max_num_batched_tokens=24)
    d.scheduler.add_request(submit("a", PROMPT, max_tokens=3))
    d.scheduler.add_request(submit("b", PROMPT, max_tokens=3))
    d.step()  # a: tokens 0..23 (fills block 0); no budget left for b
    plan = d.step()  # a: tokens 24..39 (fills block 1); b joins with the 8 tokens left
    assert plan is not None
    (b,) = plan.new_requests
    assert b.num_computed_tokens == 2 * BS  # block 1 is written by a in this very step
    assert plan.num_scheduled_tokens == {"a": 16, "b": 8}
    d.run()
    assert d.client.outputs["b"] == [token_at("b", p) for p in range(40, 43)]


def test_every_sibling_allocation_equals_its_estimate() -> None:
    d = make()
    kv = d.scheduler.kv
    real = kv.allocate_slots
    taken: list[tuple[int, int]] = []

    def checked(req, num_new, hit=None, num_hit=None):  # type: ignore[no-untyped-def]
        estimate = kv.estimate_blocks_to_allocate(req, num_new, hit, num_hit)
        before = kv.num_free_blocks
        result = real(req, num_new, hit, num_hit)
        assert result is not None
        taken.append((estimate, before - kv.num_free_blocks))
        return result

    kv.allocate_slots = checked  # type: ignore[method-assign]
    add_siblings(d, PROMPT)
    d.run()
    assert taken[:4] == [(3, 3), (1, 1), (1, 1), (1, 1)]
    assert all(estimate == actual for estimate, actual in taken)


def test_a_failed_step_leaves_no_hash_on_the_blocks_it_was_to_write() -> None:
    d = make()
    d.scheduler.add_request(submit("old", PROMPT[:16] + [9] * 3, max_tokens=1))
    d.run()  # block 0 of PROMPT is now cached by a step that succeeded
    pool = d.scheduler.kv.pool
    cached_before = dict(pool.cached)
    assert len(cached_before) == 1
    add_siblings(d, PROMPT, n=3)
    plan = d.scheduler.schedule()
    assert plan is not None
    assert len(pool.cached) == 2  # block 1, registered at allocation, not yet written
    d.scheduler.update_from_output(plan, StepResult(step_id=plan.step_id, worker_id="w", error="x"))
    assert pool.cached == cached_before  # the earlier, written block stays a valid hit
    assert all(b.block_hash is None or pool.cached.get(b.block_hash) is b for b in pool.blocks)
    # Recomputed from scratch: the first sibling hits only the old block, the others hit the
    # first's again (registered anew by the new step).
    d.worker = WorkerDouble(block_size=BS, incarnation="w1")
    d.scheduler.reset_worker_state("w1")
    d.scheduler.add_request(submit("fresh", PROMPT, max_tokens=2))
    plan = d.step()
    assert plan is not None
    computed = {r.request_id: r.num_computed_tokens for r in plan.new_requests}
    assert computed == {"c0": 0, "c1": 2 * BS, "c2": 2 * BS, "fresh": 2 * BS}
    d.run()
    assert set(d.client.finish.values()) == {"length"}


def test_failed_step_without_reset_keeps_the_pool_consistent() -> None:
    """Only the failed step's registrations are dropped, even for a sibling aborted while the
    step ran (its blocks went back to the free queue still carrying their hashes)."""
    d = make()
    add_siblings(d, PROMPT, n=2)
    plan = d.scheduler.schedule()
    assert plan is not None
    d.scheduler.abort_request("c0")
    pool = d.scheduler.kv.pool
    assert pool.cached  # c0's full prompt blocks, now free but findable
    d.worker.run(plan)  # the worker took the plan in, then its step failed
    d.scheduler.update_from_output(plan, StepResult(step_id=plan.step_id, worker_id="w", error="x"))
    assert not pool.cached
    assert all(b.block_hash is None for b in pool.blocks)
    plan = d.step()  # no worker reset: the recomputed sibling is sent again, and hits nothing
    assert plan is not None and plan.preempted_request_ids == ["c1"]
    assert [(r.request_id, r.num_computed_tokens) for r in plan.new_requests] == [("c1", 0)]
    d.run()
    assert d.client.finish == {"c1": "length"}
