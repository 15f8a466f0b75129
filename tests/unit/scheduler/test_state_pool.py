"""A hybrid model's state pool beside the attention pool (SGLang's MambaPool beside its KV
pool): the two id spaces are independent, each pool's free blocks bound admission on their own
(a full state pool blocks a request however many attention blocks are free, and the reverse),
prefix-cache entries, uncaching and resets stay in their own pool, and the feasibility bound
and the usage reported for routing look at each pool."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.kv.kv_cache_spec import FullAttentionSpec, KVCacheGroup, StateSpec
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerSettings
from shared.kv.groups import STATE
from shared.protocol import WorkerReady
from tests.unit.scheduler.driver import ClientView, submit
from tests.unit.scheduler.group_worker import GroupWorker
from tests.unit.scheduler.test_hybrid_kv_cache import (
    BS,
    allocate_checked,
    expected,
    ready,
    request,
)

FULL, STATE_GROUP = 0, 1


def config(num_gpu_blocks: int, num_state_blocks: int, **kw: object) -> SchedulerConfig:
    fields: dict[str, object] = {"max_num_batched_tokens": 64, "max_model_len": 256, **kw}
    return SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        num_state_blocks=num_state_blocks,
        kv_cache_groups=[
            KVCacheGroup(spec=FullAttentionSpec(block_size=BS)),
            KVCacheGroup(spec=StateSpec(block_size=BS)),
        ],
        **fields,  # type: ignore[arg-type]
    )


def manager(num_gpu_blocks: int, num_state_blocks: int) -> KVCacheManager:
    return KVCacheManager(config(num_gpu_blocks, num_state_blocks))


def test_each_group_takes_ids_from_its_own_pool() -> None:
    kv = manager(100, 10)
    assert kv.state_pool is not None and kv.pools == [kv.pool, kv.state_pool]
    req = request("a", list(range(12)))  # 3 blocks in each group's table
    assert kv.blocks_to_allocate(req, 12) == [3, 3]
    allocate_checked(kv, req, 12)
    full, state = kv.coordinator.get_blocks("a")
    # Both id spaces start at 1 (0 is each pool's own null block).
    assert [b.block_id for b in full] == [1, 2, 3] == [b.block_id for b in state]
    assert all(b is kv.pool.blocks[b.block_id] for b in full)
    assert all(b is kv.state_pool.blocks[b.block_id] for b in state)
    assert (kv.pool.num_free_blocks, kv.state_pool.num_free_blocks) == (99 - 3, 9 - 3)
    assert kv.num_free_blocks == 96 + 6 and kv.num_usable_blocks == 99 + 9
    kv.free(req)
    assert (kv.pool.num_free_blocks, kv.state_pool.num_free_blocks) == (99, 9)


def test_a_full_state_pool_blocks_admission_with_attention_blocks_free() -> None:
    kv = manager(200, 4)  # 3 usable state blocks
    first = request("a", list(range(8)))
    allocate_checked(kv, first, 8)  # 2 state blocks held
    second = request("b", list(range(100, 108)))
    assert kv.blocks_to_allocate(second, 8) == [2, 2]
    assert not kv.fits([2, 2]) and kv.fits([2, 1])
    assert kv.pool.num_free_blocks == 197  # plenty of attention
    before = (kv.pool.num_free_blocks, kv.state_pool.num_free_blocks)  # type: ignore[union-attr]
    assert kv.allocate_slots(second, 8) is None
    assert (kv.pool.num_free_blocks, kv.state_pool.num_free_blocks) == before  # type: ignore[union-attr]
    assert kv.coordinator.get_blocks("b") == [[], []]
    # One token fits: 1 block in each pool.
    assert kv.allocate_slots(second, 1) is not None


def test_a_full_attention_pool_blocks_admission_with_state_blocks_free() -> None:
    kv = manager(4, 50)  # 3 usable attention blocks
    allocate_checked(kv, request("a", list(range(8))), 8)
    second = request("b", list(range(100, 108)))
    assert kv.blocks_to_allocate(second, 8) == [2, 2]
    assert kv.state_pool is not None and kv.state_pool.num_free_blocks == 47
    assert kv.allocate_slots(second, 8) is None
    assert kv.state_pool.num_free_blocks == 47


def test_prefix_cache_entries_stay_in_their_pool_and_uncache_finds_them() -> None:
    kv = manager(100, 20)
    req = request("a", list(range(17)))
    allocate_checked(kv, req, 16)  # attention registers its 4 full blocks at once
    req.append_output_token(7)
    allocate_checked(kv, req, 1)  # the state group registers what the last call filled
    assert kv.state_pool is not None
    attention_keys = {key[1] for key in kv.pool.cached}
    state_keys = {key[1] for key in kv.state_pool.cached}
    assert attention_keys == {FULL} and state_keys == {STATE_GROUP}
    assert len(kv.pool.cached) == 4 and len(kv.state_pool.cached) == 4
    # Only group 0 (attention) is reported to the gateways.
    assert len(kv.pool.reported_hashes()) == 4 and kv.state_pool.reported_hashes() == []
    # Attention blocks are registered by the step that fills them (unwritten until it ran);
    # state blocks one allocation later, once written.
    newly = kv.take_newly_cached()
    assert {b.block_hash[1] for b in newly if b.block_hash} == {FULL}
    states = list(kv.state_pool.cached.values())
    kv.uncache([*newly, *states])  # each block leaves its own pool's map
    assert not kv.pool.cached and not kv.state_pool.cached
    assert all(b.block_hash is None for b in [*newly, *states])
    kv.free(req)
    kv.reset_prefix_cache()
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_state_hit_revives_a_block_of_the_state_pool() -> None:
    kv = manager(100, 20)
    prefix = list(range(500, 516))  # 4 blocks
    first = request("a", [*prefix, 1])
    allocate_checked(kv, first, 16)
    first.append_output_token(5)
    allocate_checked(kv, first, 1)
    kv.free(first)
    second = request("b", [*prefix, 2, 3])
    hit, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 16
    state_hit = [b for b in hit[STATE_GROUP] if not b.is_null]
    assert len(state_hit) == 1 and state_hit[0] is kv.state_pool.blocks[state_hit[0].block_id]  # type: ignore[union-attr]
    assert all(b is kv.state_pool.null_block for b in hit[STATE_GROUP][:-1])  # type: ignore[union-attr]
    # 4 attention blocks + 1 state block revived, 1 new block in each pool.
    assert kv.blocks_to_allocate(second, 2, hit, num_hit) == [5, 2]
    allocate_checked(kv, second, 2, hit, num_hit)


def test_usage_is_the_fuller_pools() -> None:
    kv = manager(101, 5)  # 100 and 4 usable
    allocate_checked(kv, request("a", list(range(8))), 8)
    assert kv.pool.usage == pytest.approx(0.02)
    assert kv.state_pool is not None and kv.state_pool.usage == pytest.approx(0.5)
    assert kv.usage == pytest.approx(0.5)


def test_a_request_whose_state_peak_exceeds_the_state_pool_is_refused() -> None:
    """Prefill chunks of 64 tokens hold up to ceil(65 / 4) + 1 = 18 state blocks: a state pool
    of 10 can never hold a long prompt's chunk, though attention could."""
    sched = Scheduler(config(500, 10), "s")
    kv = sched.kv
    assert kv.too_large(8) is None
    reason = kv.too_large(200)
    assert reason is not None and "state blocks" in reason and "the 9 the cache holds" in reason
    delta = sched.add_request(submit("long", list(range(200)), max_tokens=4))
    assert delta is not None and delta.finish_reason == "error"
    assert sched.add_request(submit("short", list(range(6)), max_tokens=2)) is None


def test_requests_wait_for_the_state_pool_and_finish_right() -> None:
    """Eight requests, attention for all of them, state blocks for a few at a time: the
    scheduler admits what fits, preempts or queues the rest, and every read state is right."""
    sched = Scheduler(config(400, 9, max_num_batched_tokens=12), "s")
    worker = GroupWorker(BS, [None, STATE])
    lengths = {f"r{i}": 5 + 3 * i for i in range(8)}
    for rid, n in lengths.items():
        sched.add_request(submit(rid, list(range(10 * n, 11 * n)), max_tokens=6))
    client = ClientView()
    held_back_by_states = 0  # steps with requests waiting, attention free, the state pool not
    while (plan := sched.schedule()) is not None:
        state_pool = sched.kv.state_pool
        assert state_pool is not None
        if sched.waiting and sched.kv.pool.num_free_blocks > 300 and state_pool.num_free_blocks < 3:
            held_back_by_states += 1
        for stream, deltas in sched.update_from_output(plan, worker.run(plan)).deltas.items():
            for delta in deltas:
                client.apply(stream, delta)
    for rid, n in lengths.items():
        assert client.outputs[rid] == expected(rid, n, 6)
    assert held_back_by_states > 0
    assert worker.states_read > 0
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_config_takes_the_state_pool_from_the_worker() -> None:
    fields = ready([None, STATE], 61).model_dump()
    cfg = SchedulerConfig.from_worker(
        SchedulerSettings(), WorkerReady(**fields | {"num_state_blocks": 7})
    )
    assert (cfg.num_gpu_blocks, cfg.num_state_blocks) == (61, 7)
    kv = KVCacheManager(cfg)
    assert kv.state_pool is not None and kv.state_pool.num_blocks == 7
    # A worker that announced no state pool: state groups share the attention pool.
    shared = KVCacheManager(SchedulerConfig.from_worker(SchedulerSettings(), WorkerReady(**fields)))
    assert shared.state_pool is None and shared.pools == [shared.pool]


def test_a_state_pool_needs_two_blocks_and_a_state_group() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        config(10, 1)
    with pytest.raises(ValueError, match="without a state group"):
        SchedulerConfig(block_size=BS, num_gpu_blocks=10, num_state_blocks=5)
    full_only = WorkerReady(**ready([None], 61).model_dump() | {"num_state_blocks": 5})
    with pytest.raises(ValueError, match="without a state group"):
        SchedulerConfig.from_worker(SchedulerSettings(), full_only)
    with pytest.raises(ValidationError, match="at least 2"):
        WorkerReady(**ready([None, STATE], 61).model_dump() | {"num_state_blocks": 1})
