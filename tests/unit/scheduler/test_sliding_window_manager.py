"""SlidingWindowManager: hits scan from the end for a window's run of cached blocks; blocks that
fall out of the window go back to the pool and become the null block in the table."""

from __future__ import annotations

import pytest

from services.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from services.scheduler.kv.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from services.scheduler.kv.single_type_manager import (
    FullAttentionManager,
    SlidingWindowManager,
    make_manager,
)
from shared.kv.block_hash import extend_block_hashes

BS = 4


def hashes(num_blocks: int) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, list(range(100, 100 + BS * num_blocks)), BS)
    return out


def sliding(window: int, pool: BlockPool | None = None) -> SlidingWindowManager:
    spec = SlidingWindowSpec(block_size=BS, sliding_window=window)
    manager = make_manager(spec, pool or BlockPool(64), 0, enable_caching=True)
    assert isinstance(manager, SlidingWindowManager)
    return manager


def cache(pool: BlockPool, block_hashes: list[bytes], indexes: set[int]) -> dict[int, KVCacheBlock]:
    """Cached, free blocks holding the given block indexes of the prefix (group 0)."""
    blocks = pool.get_new_blocks(len(indexes))
    order = sorted(indexes)
    pool.cache_full_blocks(blocks, [block_hashes[i] for i in order], 0)
    pool.free_blocks(blocks)
    return dict(zip(order, blocks, strict=True))


def test_hit_is_the_last_window_run_with_null_blocks_before_it() -> None:
    pool = BlockPool(64)
    h = hashes(8)
    cached = cache(pool, h, {0, 1, 2, 4, 5})
    manager = sliding(9, pool)  # the token at h reads h-8..h: 8 positions = 2 blocks before h
    hit = manager.find_longest_cache_hit(h, 8 * BS)
    assert hit == [pool.null_block] * 4 + [cached[4], cached[5]]
    # Full attention on the same cache stops at the first miss.
    full = FullAttentionManager(FullAttentionSpec(block_size=BS), pool, 0, True)
    assert full.find_longest_cache_hit(h, 8 * BS) == [cached[0], cached[1], cached[2]]


def test_without_a_full_window_run_the_leading_run_is_the_hit() -> None:
    pool = BlockPool(64)
    h = hashes(8)
    cached = cache(pool, h, {0, 5})  # block 5 alone is too short a run; block 0 has no past
    assert sliding(9, pool).find_longest_cache_hit(h, 8 * BS) == [cached[0]]
    assert sliding(9, pool).find_longest_cache_hit(h[1:], 7 * BS) == []


@pytest.mark.parametrize(("window", "run"), [(5, 1), (6, 2), (9, 2), (10, 3)])
def test_run_length_is_ceil_of_window_minus_one_over_block_size(window: int, run: int) -> None:
    """Blocks 4 and 5 cached, 3 missing: a hit ending at block 6 needs exactly `run` blocks."""
    pool = BlockPool(64)
    h = hashes(6)
    cached = cache(pool, h, {4, 5})
    hit = sliding(window, pool).find_longest_cache_hit(h, 6 * BS)
    if run <= 2:  # the hit ends at block 6 and holds only the run's blocks
        assert len(hit) == 6 and hit[6 - run :] == [cached[i] for i in range(6 - run, 6)]
        assert all(b.is_null for b in hit[: 6 - run])
    else:
        assert hit == []


def test_hit_respects_max_length_and_disabled_caching() -> None:
    pool = BlockPool(64)
    h = hashes(8)
    cached = cache(pool, h, set(range(8)))
    hit = sliding(9, pool).find_longest_cache_hit(h, 7 * BS + 3)  # 7 whole blocks at most
    assert hit == [pool.null_block] * 5 + [cached[5], cached[6]]
    spec = SlidingWindowSpec(block_size=BS, sliding_window=9)
    assert SlidingWindowManager(spec, pool, 0, False).find_longest_cache_hit(h, 32) == []


def test_skipped_blocks_become_null_and_return_to_the_pool_tail_first() -> None:
    pool = BlockPool(16)
    manager = sliding(9, pool)
    blocks = manager.allocate_new_blocks("r", 20)  # 5 blocks, positions 0..19
    free = pool.num_free_blocks
    # Next token at 11 reads 3..11: block 0 (0..3) is still needed.
    manager.remove_skipped_blocks("r", 11)
    assert pool.num_free_blocks == free
    # Next token at 12 reads 4..12: block 0 is out.
    manager.remove_skipped_blocks("r", 12)
    assert pool.num_free_blocks == free + 1
    manager.remove_skipped_blocks("r", 20)  # reads 12..20: blocks 1, 2 out too
    table = manager.blocks_of("r")
    assert len(table) == 5  # the table keeps its length: positions never move
    assert table[:3] == [pool.null_block] * 3 and table[3:] == blocks[3:]
    assert pool.num_free_blocks == free + 3
    # Each call frees tail first: the head of what is left is evicted last.
    assert list(pool.free_queue)[-3:] == [b.block_id for b in (blocks[0], blocks[2], blocks[1])]
    manager.remove_skipped_blocks("r", 20)  # idempotent
    assert pool.num_free_blocks == free + 3
    manager.free("r")
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_shared_skipped_block_stays_held_by_its_other_user() -> None:
    pool = BlockPool(16)
    manager = sliding(5, pool)
    blocks = manager.allocate_new_blocks("r", 12)
    pool.touch(blocks[:1])  # e.g. another request's prefix hit
    manager.remove_skipped_blocks("r", 12)  # reads 8..12: blocks 0, 1 out
    assert blocks[0].ref_cnt == 1 and blocks[1].ref_cnt == 0
    assert blocks[0].block_id not in pool.free_queue


@pytest.mark.parametrize("step", [1, 7, 64])
def test_max_blocks_held_bounds_every_step_of_a_long_request(step: int) -> None:
    """Chunked prefill then decode of 300 tokens: after each allocation the non-null entries
    never exceed the bound, and the bound is the full count for a short request."""
    pool = BlockPool(256)
    manager = sliding(10, pool)
    bound = manager.max_blocks_held(10_000, step)
    computed, peak = 0, 0
    while computed < 300:
        n = min(step, 300 - computed)
        manager.remove_skipped_blocks("r", computed)
        manager.allocate_new_blocks("r", computed + n)
        computed += n
        peak = max(peak, sum(not b.is_null for b in manager.blocks_of("r")))
    assert peak <= bound
    assert manager.max_blocks_held(6, step) == 2  # short: every block is held
