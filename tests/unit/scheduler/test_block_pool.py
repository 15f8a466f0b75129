"""BlockPool: reference counts, the null block, LRU free order, eviction of cached blocks."""

from __future__ import annotations

import pytest

from services.scheduler.kv.block_pool import BlockPool
from shared.kv.block_hash import extend_block_hashes


def hashes(n: int, seed: int = 0) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, [seed * 1000 + i for i in range(16 * n)], 16)
    return out


def test_alloc_and_free_keep_counts_and_never_hand_out_the_null_block() -> None:
    pool = BlockPool(9)
    assert pool.num_free_blocks == 8
    blocks = pool.get_new_blocks(8)
    assert sorted(b.block_id for b in blocks) == list(range(1, 9))
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.touch(blocks[:2])  # a second holder
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 6
    assert [b.ref_cnt for b in blocks[:2]] == [1, 1]
    pool.free_blocks(blocks[:2])
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    with pytest.raises(RuntimeError):
        pool.free_blocks(blocks[:1])


def test_free_queue_is_lru_and_freed_blocks_join_the_tail() -> None:
    pool = BlockPool(7)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(3)
    pool.free_blocks(reversed(b))  # a request's blocks, tail first
    pool.free_blocks(reversed(a))
    order = [blk.block_id for blk in pool.get_new_blocks(6)]
    assert order == [blk.block_id for blk in [*reversed(b), *reversed(a)]]


def test_touching_a_cached_free_block_revives_it_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, hashes(4), group_id=0)
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(hashes(4)[2], 0)
    assert hit is blocks[2]
    pool.touch([hit])
    assert pool.num_free_blocks == 3 and hit.ref_cnt == 1
    rest = pool.get_new_blocks(3)
    assert hit not in rest
    # The revived block kept its hash; the others were evicted on reuse.
    assert pool.get_cached_block(hashes(4)[2], 0) is hit
    assert all(pool.get_cached_block(h, 0) is None for i, h in enumerate(hashes(4)) if i != 2)
    assert all(b.block_hash is None for b in rest)


def test_eviction_takes_the_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(5)
    old = pool.get_new_blocks(2)
    new = pool.get_new_blocks(2)
    pool.cache_full_blocks(old, hashes(2, seed=1), 0)
    pool.cache_full_blocks(new, hashes(2, seed=2), 0)
    pool.free_blocks(reversed(old))
    pool.free_blocks(reversed(new))
    pool.get_new_blocks(1)  # evicts old's tail block
    assert pool.get_cached_block(hashes(2, seed=1)[1], 0) is None
    assert pool.get_cached_block(hashes(2, seed=1)[0], 0) is old[0]
    assert all(pool.get_cached_block(h, 0) is not None for h in hashes(2, seed=2))
    assert len(pool.cached) == 3


def test_same_hash_in_two_groups_names_two_blocks_and_duplicates_stay_anonymous() -> None:
    pool = BlockPool(5)
    g0, g1, dup = pool.get_new_blocks(1), pool.get_new_blocks(1), pool.get_new_blocks(1)
    h = hashes(1)
    pool.cache_full_blocks(g0, h, 0)
    pool.cache_full_blocks(g1, h, 1)
    pool.cache_full_blocks(dup, h, 0)
    assert pool.get_cached_block(h[0], 0) is g0[0]
    assert pool.get_cached_block(h[0], 1) is g1[0]
    assert dup[0].block_hash is None


def test_disabled_caching_registers_nothing() -> None:
    pool = BlockPool(3, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes(2), 0)
    assert not pool.cached and all(b.block_hash is None for b in blocks)


def test_reset_prefix_cache_needs_an_idle_pool() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes(2), 0)
    with pytest.raises(RuntimeError):
        pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert not pool.cached and all(b.block_hash is None for b in blocks)
    assert pool.num_free_blocks == 2
