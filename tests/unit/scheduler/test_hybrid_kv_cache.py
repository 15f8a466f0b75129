"""Several KV cache groups (full attention + sliding window) on one pool: the hybrid prefix hit
(a fixed point over groups), estimate == allocation on every path, bounded sliding-window blocks
through whole scheduler runs, and the groups built from what the worker announces."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from services.scheduler.kv.kv_cache_coordinator import KVCacheBlocks, KVCacheCoordinator
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.kv.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerSettings
from shared.kv.block_hash import extend_block_hashes
from shared.kv.groups import kv_groups_for
from shared.protocol import SamplingParams, WorkerReady
from tests.unit.scheduler.driver import ClientView, submit
from tests.unit.scheduler.group_worker import GroupWorker
from tests.unit.scheduler.worker_double import token_at

BS = 4
WINDOW = 9  # a hit needs the 2 blocks before its end


def groups(*windows: int | None) -> list[KVCacheGroup]:
    return [
        KVCacheGroup(
            spec=FullAttentionSpec(block_size=BS)
            if w is None
            else SlidingWindowSpec(block_size=BS, sliding_window=w)
        )
        for w in windows
    ]


def hashes(num_blocks: int) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, list(range(100, 100 + BS * num_blocks)), BS)
    return out


def cache(pool: BlockPool, block_hashes: list[bytes], group: int, indexes: set[int]) -> None:
    blocks = pool.get_new_blocks(len(indexes))
    order = sorted(indexes)
    pool.cache_full_blocks(blocks, [block_hashes[i] for i in order], group)
    pool.free_blocks(blocks)


# ------------------------------------------------------------------------- hybrid prefix hit


@pytest.mark.parametrize("full_first", [True, False])
def test_hybrid_hit_is_a_fixed_point_every_group_serves(full_first: bool) -> None:
    """Full attention has blocks 0..4 (5 missing); the window group has 0..2 and 4..5 (3
    missing). Cutting the window's 6-block hit back to full attention's 5 blocks would need
    window blocks 3 and 4 — 3 is missing — so the window is asked again at 5 blocks, answers 3,
    and full attention is cut to 3: every group serves exactly 12 tokens."""
    pool = BlockPool(64)
    h = hashes(8)
    full, window = (0, 1) if full_first else (1, 0)
    cache(pool, h, full, {0, 1, 2, 3, 4})
    cache(pool, h, window, {0, 1, 2, 4, 5})
    windows: list[int | None] = [None, WINDOW] if full_first else [WINDOW, None]
    coordinator = KVCacheCoordinator(groups(*windows), pool, enable_caching=True)
    hits, num_tokens = coordinator.find_longest_cache_hit(h, 8 * BS)
    assert num_tokens == 3 * BS
    assert [len(g) for g in hits] == [3, 3]
    for g, group_hits in enumerate(hits):
        for i, block in enumerate(group_hits):
            if not block.is_null:
                assert block.block_hash == (h[i], g)
    assert not any(b.is_null for b in hits[full])
    assert [b.is_null for b in hits[window]] == [True, False, False]


def test_hybrid_hit_agrees_at_once_when_both_groups_serve_the_whole_length() -> None:
    pool = BlockPool(64)
    h = hashes(6)
    cache(pool, h, 0, set(range(6)))
    cache(pool, h, 1, {4, 5})
    coordinator = KVCacheCoordinator(groups(None, WINDOW), pool, enable_caching=True)
    hits, num_tokens = coordinator.find_longest_cache_hit(h, 6 * BS + 1)
    assert num_tokens == 6 * BS
    assert [b.is_null for b in hits[1]] == [True] * 4 + [False] * 2


# ---------------------------------------------------------------- estimate == allocation


def manager(num_gpu_blocks: int = 200, prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        SchedulerConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=64,
            kv_cache_groups=groups(None, WINDOW),
            enable_prefix_caching=prefix_caching,
        )
    )


@contextmanager
def blocks_taken(kv: KVCacheManager) -> Iterator[list[list[KVCacheBlock]]]:
    """Records, per pool (`kv.pools` order), every block taken out of its free queue (new or
    revived by a hit); blocks the same call gives back (out of a window) are not subtracted,
    unlike a free-count delta."""
    taken: list[list[KVCacheBlock]] = [[] for _ in kv.pools]
    originals = [(pool, pool.get_new_blocks, pool.touch) for pool in kv.pools]
    for i, (pool, get_new, touch) in enumerate(originals):

        def counting_get(
            n: int, get_new: object = get_new, out: list[KVCacheBlock] = taken[i]
        ) -> list[KVCacheBlock]:
            blocks = get_new(n)  # type: ignore[operator]
            out.extend(blocks)
            return blocks

        def counting_touch(
            blocks: object, touch: object = touch, out: list[KVCacheBlock] = taken[i]
        ) -> None:
            blocks = list(blocks)  # type: ignore[call-overload]
            out.extend(b for b in blocks if b.ref_cnt == 0 and not b.is_null)
            touch(blocks)  # type: ignore[operator]

        pool.get_new_blocks = counting_get  # type: ignore[method-assign]
        pool.touch = counting_touch  # type: ignore[method-assign]
    try:
        yield taken
    finally:
        for pool, get_new, touch in originals:
            pool.get_new_blocks = get_new  # type: ignore[method-assign]
            pool.touch = touch  # type: ignore[method-assign]


def allocate_checked(
    kv: KVCacheManager,
    req: Request,
    num_new: int,
    hit: KVCacheBlocks | None = None,
    num_hit: int | None = None,
) -> int:
    """Allocates, checking that each pool loses exactly its estimated blocks; returns the
    estimate over all pools."""
    estimate = kv.estimate_blocks_to_allocate(req, num_new, hit, num_hit)
    per_pool = kv.blocks_to_allocate(req, num_new, hit, num_hit)
    assert sum(per_pool) == estimate
    with blocks_taken(kv) as taken:
        assert kv.allocate_slots(req, num_new, hit, num_hit) is not None
    assert [len(t) for t in taken] == per_pool
    req.num_computed_tokens += (num_hit or 0) + num_new
    return estimate


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), "replies", BS)


def test_fresh_request_takes_one_table_per_group() -> None:
    kv = manager()
    assert allocate_checked(kv, request("a", list(range(30))), 30) == 2 * 8


def test_chunked_prefill_and_decode_with_window_blocks_going_back() -> None:
    kv = manager()
    req = request("a", list(range(70)))
    free = kv.num_free_blocks
    for chunk in (16, 16, 16, 16, 6):
        allocate_checked(kv, req, chunk)
    for i in range(30):
        req.append_output_token(1000 + i)
        allocate_checked(kv, req, 1)
    table_full, table_window = kv.coordinator.get_blocks("a")
    assert len(table_full) == len(table_window) == -(-99 // BS)
    held_window = sum(not b.is_null for b in table_window)
    assert held_window <= -(-(WINDOW - 1 + 1) // BS) + 1
    assert free - kv.num_free_blocks == len(table_full) + held_window


def test_prefix_hit_counts_revived_blocks_of_both_groups_and_nulls_none() -> None:
    kv = manager()
    prefix = list(range(500, 532))  # 8 blocks
    first = request("a", [*prefix, 1, 2])
    allocate_checked(kv, first, first.num_tokens)
    kv.free(first)  # its blocks stay cached, free
    second = request("b", [*prefix, 7, 7, 7])
    hit, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 32
    assert [sum(not b.is_null for b in g) for g in hit] == [8, 2]
    # 8 + 2 revived, plus ceil(35/4) - 8 = 1 new block in each group.
    assert allocate_checked(kv, second, 3, hit, num_hit) == 10 + 2


def test_prefix_hit_on_blocks_held_by_a_running_request_revives_nothing() -> None:
    kv = manager()
    prefix = list(range(500, 532))
    first = request("a", [*prefix, 1, 2])
    allocate_checked(kv, first, first.num_tokens)
    second = request("b", [*prefix, 7])
    hit, num_hit = kv.get_computed_blocks(second)
    assert allocate_checked(kv, second, 1, hit, num_hit) == 2  # one new block per group


def test_routed_experts_request_takes_no_prefix_hit() -> None:
    kv = manager()
    prefix = list(range(500, 532))
    first = request("a", [*prefix, 1])
    allocate_checked(kv, first, first.num_tokens)
    kv.free(first)
    routed = Request("r", [*prefix, 2], SamplingParams(), "replies", BS, return_routed_experts=True)
    hit, num_hit = kv.get_computed_blocks(routed)
    assert num_hit == 0 and hit == [[], []]
    assert allocate_checked(kv, routed, routed.num_tokens, hit, num_hit) == 2 * 9


# ------------------------------------------------------------ whole runs through the scheduler


def run(scheduler: Scheduler, worker: GroupWorker, client: ClientView | None = None) -> ClientView:
    client = client or ClientView()
    for _ in range(5000):
        plan = scheduler.schedule()
        if plan is None:
            assert not scheduler.has_work()
            return client
        out = scheduler.update_from_output(plan, worker.run(plan))
        for stream, deltas in out.deltas.items():
            for delta in deltas:
                client.apply(stream, delta)
    raise AssertionError("not done")


def expected(rid: str, prompt_len: int, n: int) -> list[int]:
    return [token_at(rid, prompt_len + i) for i in range(n)]


def test_long_generation_holds_a_bounded_number_of_window_blocks() -> None:
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=200,
        max_num_batched_tokens=8,
        max_model_len=512,
        kv_cache_groups=groups(None, 16),
    )
    scheduler = Scheduler(config, "s0")
    worker = GroupWorker(BS, [None, 16])
    scheduler.add_request(submit("a", list(range(20, 40)), max_tokens=150))
    client = ClientView()
    peak_window = 0
    while (plan := scheduler.schedule()) is not None:
        full, window = scheduler.kv.coordinator.get_blocks("a")
        assert len(full) == len(window)
        peak_window = max(peak_window, sum(not b.is_null for b in window))
        out = scheduler.update_from_output(plan, worker.run(plan))
        for stream, deltas in out.deltas.items():
            for delta in deltas:
                client.apply(stream, delta)
    assert client.outputs["a"] == expected("a", 20, 150)
    assert len(full) == -(-(20 + 149) // BS)  # full attention keeps everything
    assert peak_window <= -(-(16 - 1 + 8) // BS) + 1  # 7, against 43 blocks of the sequence
    assert worker.positions_read > 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_many_requests_under_pressure_never_read_a_reused_window_block() -> None:
    """A pool too small for everyone at once: preemption, chunking and window blocks returned
    mid-run and handed to other requests; every read of every step hits the right token."""
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=48,
        max_num_batched_tokens=24,
        max_model_len=256,
        kv_cache_groups=groups(None, 6, 13),
    )
    scheduler = Scheduler(config, "s0")
    worker = GroupWorker(BS, [None, 6, 13])
    shared = list(range(300, 316))
    lengths = {}
    for i in range(8):
        prompt = [*shared, *range(1000 * i, 1000 * i + 3 + 5 * i)] if i % 2 else shared[: 9 + i]
        lengths[f"r{i}"] = len(prompt)
        scheduler.add_request(submit(f"r{i}", prompt, max_tokens=25 + 3 * i))
    client = run(scheduler, worker)
    for rid, prompt_len in lengths.items():
        assert client.outputs[rid] == expected(rid, prompt_len, 25 + 3 * int(rid[1:]))
    assert scheduler.num_preemptions > 0
    assert scheduler.kv.stats.hits > 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_new_request_after_a_hit_carries_null_ids_outside_the_window() -> None:
    config = SchedulerConfig(
        block_size=BS, num_gpu_blocks=100, max_model_len=256, kv_cache_groups=groups(None, WINDOW)
    )
    scheduler = Scheduler(config, "s0")
    worker = GroupWorker(BS, [None, WINDOW])
    prefix = list(range(700, 732))
    scheduler.add_request(submit("a", [*prefix, 1], max_tokens=2))
    run(scheduler, worker)
    scheduler.add_request(submit("b", [*prefix, 2, 3], max_tokens=3))
    plan = scheduler.schedule()
    assert plan is not None
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 32
    assert len(new.block_ids[0]) == len(new.block_ids[1]) == 9
    assert list(new.block_ids[1][:6]) == [0] * 6 and 0 not in new.block_ids[1][6:]
    assert 0 not in new.block_ids[0]
    client = ClientView()
    for stream, deltas in scheduler.update_from_output(plan, worker.run(plan)).deltas.items():
        for delta in deltas:
            client.apply(stream, delta)
    run(scheduler, worker, client)
    assert client.outputs["b"] == expected("b", 34, 3)


# ------------------------------------------------------------------- groups from the worker


def ready(windows: list[int | None], num_kv_blocks: int = 64) -> WorkerReady:
    return WorkerReady(
        worker_id="w",
        incarnation="i",
        model="m",
        num_kv_blocks=num_kv_blocks,
        block_size=BS,
        vocab_size=1000,
        max_model_len=256,
        kv_groups=kv_groups_for(windows),
    )


def test_config_builds_groups_in_the_workers_order() -> None:
    config = SchedulerConfig.from_worker(SchedulerSettings(), ready([16, None, 8, 16]))
    specs = [g.spec for g in config.kv_cache_groups]
    assert specs == [
        FullAttentionSpec(block_size=BS),
        SlidingWindowSpec(block_size=BS, sliding_window=8),
        SlidingWindowSpec(block_size=BS, sliding_window=16),
    ]
    assert [g.layer_names for g in config.kv_cache_groups] == [("1",), ("2",), ("0", "3")]
    legacy = ready([None]).model_copy(update={"kv_groups": []})
    (only,) = SchedulerConfig.from_worker(SchedulerSettings(), legacy).kv_cache_groups
    assert only.spec == FullAttentionSpec(block_size=BS)


def test_admission_bound_counts_a_window_group_by_its_window() -> None:
    """200 tokens need 50 full blocks; the window group holds at most
    ceil((8 - 1 + 16) / 4) + 1 = 7 — admitted into 60 usable blocks, which two full groups
    (100 blocks) would refuse."""
    settings = SchedulerSettings(max_num_batched_tokens=16)
    hybrid = Scheduler(SchedulerConfig.from_worker(settings, ready([None, 8], 61)), "s0")
    assert hybrid.add_request(submit("a", list(range(50, 101)), max_tokens=150)) is None
    client = run(hybrid, GroupWorker(BS, [None, 8]))
    assert client.outputs["a"] == expected("a", 51, 150)
    as_full = SchedulerConfig.from_worker(settings, ready([None], 61)).model_copy(
        update={"kv_cache_groups": groups(None, None)}
    )
    two_full = Scheduler(as_full, "s0")
    refused = two_full.add_request(submit("a", list(range(50, 101)), max_tokens=150))
    assert refused is not None and refused.finish_reason == "error"
