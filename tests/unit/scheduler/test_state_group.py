"""A recurrent-state (Mamba-style) group beside full attention, on its own state pool (the
worker's layout) and on the attention pool (a worker that announced no state pool): the hit
rule (a state exactly at a block boundary), estimate == allocation on every path, a bounded
number of state blocks however long a request runs, whole runs whose every state read is checked
(GroupWorker keeps each block's state), states written in a step never hit in that same step,
and the offload tier storing attention groups only ("transferable is not storable")."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.block_pool import BlockPool
from services.scheduler.kv.kv_cache_coordinator import KVCacheCoordinator
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.kv.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    StateSpec,
)
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector
from services.scheduler.offload.store_admission import StoreAdmission
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerSettings
from shared.kv.groups import STATE
from tests.unit.scheduler.driver import ClientView, submit
from tests.unit.scheduler.group_worker import GroupWorker
from tests.unit.scheduler.offload.harness import SPACE, Tier
from tests.unit.scheduler.test_hybrid_kv_cache import (
    BS,
    allocate_checked,
    cache,
    expected,
    hashes,
    ready,
    request,
    run,
)


def groups() -> list[KVCacheGroup]:
    return [
        KVCacheGroup(spec=FullAttentionSpec(block_size=BS)),
        KVCacheGroup(spec=StateSpec(block_size=BS)),
    ]


#: num_state_blocks of the configs: 0 = state groups on the attention pool, else a state pool.
LAYOUTS = pytest.mark.parametrize("state_blocks", [0, 40], ids=["one-pool", "state-pool"])


def manager(num_gpu_blocks: int = 200, state_blocks: int = 0) -> KVCacheManager:
    return KVCacheManager(
        SchedulerConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            num_state_blocks=state_blocks,
            max_num_batched_tokens=64,
            kv_cache_groups=groups(),
        )
    )


# ------------------------------------------------------------------------------- hit rule


def test_state_hit_is_the_last_cached_boundary_every_group_serves() -> None:
    """Full attention has blocks 0..5; the state group has states after blocks 1 and 3 (the
    others evicted). The longest boundary both serve is 4 blocks: full attention is cut to 4,
    the state group answers its block 3 with null entries before it."""
    pool = BlockPool(64)
    h = hashes(8)
    cache(pool, h, 0, {0, 1, 2, 3, 4, 5})
    cache(pool, h, 1, {1, 3})
    coordinator = KVCacheCoordinator(groups(), pool, enable_caching=True)
    hits, num_tokens = coordinator.find_longest_cache_hit(h, 8 * BS)
    assert num_tokens == 4 * BS
    assert [b.is_null for b in hits[1]] == [True, True, True, False]
    assert hits[1][3].block_hash == (h[3], 1)
    assert len(hits[0]) == 4 and not any(b.is_null for b in hits[0])
    # Without a state at a boundary the full-attention prefix alone is no hit.
    pool2 = BlockPool(64)
    cache(pool2, h, 0, {0, 1, 2})
    hits2, num2 = KVCacheCoordinator(groups(), pool2, enable_caching=True).find_longest_cache_hit(
        h, 8 * BS
    )
    assert num2 == 0 and hits2 == [[], []]


def test_state_spec_is_reusable_locally_but_not_storable() -> None:
    spec = StateSpec(block_size=BS)
    assert spec.locally_cacheable and not spec.prefix_cacheable
    assert FullAttentionSpec(block_size=BS).prefix_cacheable


# ------------------------------------------------------------------ estimate == allocation


@LAYOUTS
def test_chunked_prefill_and_decode_keep_only_the_last_state_block(state_blocks: int) -> None:
    kv = manager(state_blocks=state_blocks)
    req = request("a", list(range(70)))
    free = kv.num_free_blocks
    for chunk in (16, 16, 16, 16, 6):
        allocate_checked(kv, req, chunk)
    for i in range(30):
        req.append_output_token(1000 + i)
        allocate_checked(kv, req, 1)
    table_full, table_state = kv.coordinator.get_blocks("a")
    assert len(table_full) == len(table_state) == -(-99 // BS)
    held_state = [i for i, b in enumerate(table_state) if not b.is_null]
    # The block of position n - 1 (n computed) and the block being filled by the next token.
    assert held_state and held_state[0] >= (req.num_computed_tokens - 1) // BS - 1
    assert len(held_state) <= 2
    assert free - kv.num_free_blocks == len(table_full) + len(held_state)


@LAYOUTS
def test_prefix_hit_revives_one_state_block(state_blocks: int) -> None:
    kv = manager(state_blocks=state_blocks)
    prefix = list(range(500, 532))  # 8 blocks
    first = request("a", [*prefix, 1, 2])
    allocate_checked(kv, first, 32)
    first.append_output_token(5)  # a later allocation registers the computed states
    allocate_checked(kv, first, 2)
    kv.free(first)
    second = request("b", [*prefix, 7, 7, 7])
    hit, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 32
    assert [sum(not b.is_null for b in g) for g in hit] == [8, 1]
    # 8 + 1 revived, plus ceil(35/4) - 8 = 1 new block in each group.
    assert allocate_checked(kv, second, 3, hit, num_hit) == 9 + 2


@pytest.mark.parametrize("prompt_len", [1, 4, 37, 200])
def test_admission_bound_counts_the_state_group_by_its_few_blocks(prompt_len: int) -> None:
    config = SchedulerConfig.from_worker(
        SchedulerSettings(max_num_batched_tokens=16), ready([None, STATE], 61)
    )
    assert [type(g.spec) for g in config.kv_cache_groups] == [FullAttentionSpec, StateSpec]
    kv = KVCacheManager(config)
    # Full attention: ceil(n / 4); state: ceil((1 + 16) / 4) + 1 = 6 at most.
    bound = kv.num_blocks_for_tokens(prompt_len)
    assert bound == -(-prompt_len // BS) + min(-(-prompt_len // BS), 6)


# ------------------------------------------------------------ whole runs through the scheduler


def scheduler(num_gpu_blocks: int = 200, max_tokens: int = 8, **kw: object) -> Scheduler:
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=max_tokens,
        max_model_len=512,
        kv_cache_groups=groups(),
        **kw,  # type: ignore[arg-type]
    )
    return Scheduler(config, "s0")


@LAYOUTS
def test_long_generation_reads_every_state_and_holds_few_blocks(state_blocks: int) -> None:
    sched = scheduler(max_tokens=7, num_state_blocks=state_blocks)
    worker = GroupWorker(BS, [None, STATE])
    sched.add_request(submit("a", list(range(20, 43)), max_tokens=120))
    client = ClientView()
    peak = 0
    while (plan := sched.schedule()) is not None:
        _, state = sched.kv.coordinator.get_blocks("a")
        peak = max(peak, sum(not b.is_null for b in state))
        for stream, deltas in sched.update_from_output(plan, worker.run(plan)).deltas.items():
            for delta in deltas:
                client.apply(stream, delta)
    assert client.outputs["a"] == expected("a", 23, 120)
    assert worker.states_read > 120
    assert peak <= -(-(1 + 7) // BS) + 1
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


@pytest.mark.parametrize(
    ("num_gpu_blocks", "state_blocks"), [(48, 0), (36, 20), (200, 14)], ids=str
)
def test_shared_prefixes_under_pressure_resume_from_the_right_states(
    num_gpu_blocks: int, state_blocks: int
) -> None:
    """Preemption, chunking, state blocks returned mid-run and reused by others, and prefix
    hits on states left at block boundaries: every state any step reads is the state of
    exactly the request's computed tokens. With a state pool, either pool runs out first
    (36 attention blocks; a 14-block state pool beside 200 attention blocks)."""
    sched = scheduler(num_gpu_blocks=num_gpu_blocks, max_tokens=24, num_state_blocks=state_blocks)
    worker = GroupWorker(BS, [None, STATE])
    shared = list(range(300, 324))
    lengths = {}
    for i in range(8):
        prompt = [*shared, *range(1000 * i, 1000 * i + 2 + 3 * i)] if i % 2 else shared[: 9 + i]
        lengths[f"r{i}"] = len(prompt)
        sched.add_request(submit(f"r{i}", prompt, max_tokens=20 + 3 * i))
    client = run(sched, worker)
    for rid, prompt_len in lengths.items():
        assert client.outputs[rid] == expected(rid, prompt_len, 20 + 3 * int(rid[1:]))
    assert sched.num_preemptions > 0
    assert sched.kv.stats.hits > 0
    assert worker.states_read > 0
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


@LAYOUTS
def test_a_state_written_this_step_is_not_hit_in_the_same_step(state_blocks: int) -> None:
    """Two requests with one 16-token prefix arrive together: attention lets the second hit
    the first's blocks in the same step (its K/V is written before any read), a state cannot
    be read before it is computed, so the second prefills its prefix itself; a third, after
    that step, hits the first's state at the boundary."""
    sched = scheduler(max_tokens=64, num_state_blocks=state_blocks)
    worker = GroupWorker(BS, [None, STATE])
    prefix = list(range(700, 716))
    sched.add_request(submit("a", [*prefix, 1], max_tokens=4))
    sched.add_request(submit("b", [*prefix, 2], max_tokens=4))
    plan = sched.schedule()
    assert plan is not None
    assert {n.request_id: n.num_computed_tokens for n in plan.new_requests} == {"a": 0, "b": 0}
    client = ClientView()
    for stream, deltas in sched.update_from_output(plan, worker.run(plan)).deltas.items():
        for delta in deltas:
            client.apply(stream, delta)
    sched.add_request(submit("c", [*prefix, 3], max_tokens=4))
    plan = sched.schedule()
    assert plan is not None
    assert {n.request_id: n.num_computed_tokens for n in plan.new_requests} == {"c": 16}
    for stream, deltas in sched.update_from_output(plan, worker.run(plan)).deltas.items():
        for delta in deltas:
            client.apply(stream, delta)
    run(sched, worker, client)
    assert {rid: client.outputs[rid] for rid in "abc"} == {
        rid: expected(rid, 17, 4) for rid in "abc"
    }
    assert worker.states_read > 0


# ------------------------------------------------------------------------- the offload tier


def test_the_tier_stores_attention_blocks_only_and_never_loads_a_hybrid() -> None:
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=64,
        num_state_blocks=32,
        max_num_batched_tokens=64,
        max_model_len=200,
        kv_cache_groups=groups(),
    )
    tier = Tier()
    sched = Scheduler(config, "s")
    lookup = AsyncLookup(tier.verdicts, max_pending_s=2.0)
    connector = OffloadConnector(
        config, SPACE, lookup, "t", store_admission=StoreAdmission("always")
    )
    sched.offload = connector
    assert connector.groups == [0] and not connector.loads_supported
    worker = GroupWorker(BS, [None, STATE])
    stored_groups: list[int] = []
    for i in range(3):
        sched.add_request(submit(f"r{i}", list(range(100, 120)), max_tokens=3))
        while (plan := sched.schedule()) is not None:
            stored_groups += [g for t in plan.kv_stores for g in t.groups]
            assert not plan.kv_loads
            sched.update_from_output(plan, worker.run(plan))
            asyncio.run(_flush(lookup))
    assert stored_groups and set(stored_groups) == {0}


async def _flush(lookup: AsyncLookup) -> None:
    await asyncio.gather(*lookup.flush())
