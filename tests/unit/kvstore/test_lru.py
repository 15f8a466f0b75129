"""LRU with logical ranks: pins keep ranks, atomic eviction, a bounded lazy heap, capacity."""

from __future__ import annotations

import random

import pytest

from services.kvstore.chunk_table import ChunkStatus
from services.kvstore.lru import MIN_HEAP_BOUND, LRUPolicy
from tests.unit.kvstore.prefix import prefix_keys

CHUNK_BYTES = 1000


def ready(policy: LRUPolicy, keys, nbytes: int = CHUNK_BYTES) -> None:
    for key in keys:
        assert policy.begin_store(key, nbytes).inserted
        assert policy.complete_store(key, ok=True)


def snapshot(policy: LRUPolicy) -> tuple:
    table = policy.table
    return (
        {k: (table.get(k).refs, table.get(k).nbytes) for k in table},  # type: ignore[union-attr]
        dict(policy.rank),
        table.used_bytes,
        table.evictable_count,
        policy.evictions,
    )


def test_evicts_least_recently_touched_first() -> None:
    a, b, c = prefix_keys(3)
    policy = LRUPolicy(10 * CHUNK_BYTES)
    ready(policy, [a, b, c])
    policy.touch([a])
    assert policy.evict(2) == [b, c]
    assert policy.evict(1) == [a]
    assert len(policy.table) == 0 and policy.table.used_bytes == 0


def test_touch_order_makes_the_last_key_most_recent() -> None:
    keys = prefix_keys(4)
    policy = LRUPolicy(10 * CHUNK_BYTES)
    ready(policy, keys)
    policy.touch(list(reversed(keys)))  # tail first, head last
    assert policy.evict(4) == list(reversed(keys))


def test_a_pinned_chunk_keeps_its_rank() -> None:
    a, b, c = prefix_keys(3)
    policy = LRUPolicy(10 * CHUNK_BYTES)
    ready(policy, [a, b, c])  # ranks a < b < c
    assert policy.pin(a)
    assert policy.evict(1) == [b]  # a is being read: skipped, not evicted
    policy.touch([c])
    policy.unpin(a)
    # a re-enters the evictable set with its old rank, not as if used at unpin time.
    assert policy.evict(1) == [a]


def test_touch_while_pinned_changes_rank_not_pin() -> None:
    a, b = prefix_keys(2)
    policy = LRUPolicy(10 * CHUNK_BYTES)
    ready(policy, [a, b])
    assert policy.pin(a) and policy.pin(a)
    policy.touch([a])  # recency is separate from pinning
    assert policy.status(a) is ChunkStatus.PINNED
    policy.unpin(a)
    assert policy.evict(2) is None  # a still has one reader
    policy.unpin(a)
    assert policy.evict(2) == [b, a]


def test_writing_chunks_cannot_be_pinned_or_evicted() -> None:
    a, b = prefix_keys(2)
    policy = LRUPolicy(10 * CHUNK_BYTES)
    assert policy.begin_store(a, CHUNK_BYTES).inserted
    ready(policy, [b])
    assert not policy.pin(a)
    assert policy.evict(2) is None
    assert policy.evict(1) == [b]
    assert policy.complete_store(a, ok=True)
    assert policy.evict(1) == [a]


@pytest.mark.parametrize("reason", ["pinned", "writing", "protected"])
def test_evict_with_too_few_candidates_changes_nothing(reason: str) -> None:
    keys = prefix_keys(5)
    policy = LRUPolicy(10 * CHUNK_BYTES)
    ready(policy, keys[:4])
    policy.touch([keys[1], keys[0]])
    protected: set = set()
    if reason == "pinned":
        assert policy.pin(keys[2])
    elif reason == "writing":
        policy.begin_store(keys[4], CHUNK_BYTES)
    else:
        protected = {keys[2]}
    before = snapshot(policy)
    candidates = policy.table.evictable_count - len(protected)
    assert policy.evict(candidates + 1, protected) is None
    assert snapshot(policy) == before
    # ... and the heap still gives the right order afterwards.
    expected = [k for k in (keys[2], keys[3], keys[1], keys[0]) if policy.table.is_evictable(k)]
    expected = [k for k in expected if k not in protected]
    assert policy.evict(candidates, protected) == expected


def test_evict_skips_protected_keys_and_leaves_them_in_place() -> None:
    a, b, c = prefix_keys(3)
    policy = LRUPolicy(10 * CHUNK_BYTES)
    ready(policy, [a, b, c])
    assert policy.evict(1, protected={a}) == [b]
    assert policy.evict(2) == [a, c]


def test_make_room_evicts_by_bytes_least_recent_first() -> None:
    keys = prefix_keys(4)
    policy = LRUPolicy(4 * CHUNK_BYTES)
    ready(policy, keys[:3])
    admission = policy.begin_store(keys[3], 2 * CHUNK_BYTES)
    assert admission.inserted and admission.evicted == [keys[0]]
    assert policy.table.used_bytes == 4 * CHUNK_BYTES


def test_store_refused_when_room_cannot_be_made_changes_nothing() -> None:
    keys = prefix_keys(3)
    policy = LRUPolicy(2 * CHUNK_BYTES)
    ready(policy, keys[:2])
    assert policy.pin(keys[0])
    before = snapshot(policy)
    admission = policy.begin_store(keys[2], 2 * CHUNK_BYTES)
    assert not admission.inserted and admission.reason == "full" and admission.evicted == []
    assert snapshot(policy) == before
    assert policy.begin_store(keys[2], 3 * CHUNK_BYTES).reason == "too_large"
    assert policy.begin_store(keys[0], CHUNK_BYTES).reason == "present"


def test_failed_write_frees_its_bytes() -> None:
    (a,) = prefix_keys(1)
    policy = LRUPolicy(CHUNK_BYTES)
    assert policy.begin_store(a, CHUNK_BYTES).inserted
    assert policy.complete_store(a, ok=False)
    assert a not in policy.table and policy.table.used_bytes == 0
    assert not policy.complete_store(a, ok=True)  # a late report for a removed chunk


def test_heavy_reranking_keeps_the_heap_bounded_and_the_order_right() -> None:
    rng = random.Random(7)
    keys = prefix_keys(200)
    policy = LRUPolicy(1000 * CHUNK_BYTES)
    ready(policy, keys)
    last_touch = {k: i for i, k in enumerate(keys)}
    clock = len(keys)
    pinned: set = set()
    for _ in range(20_000):
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.05 and key not in pinned:
            assert policy.pin(key)
            pinned.add(key)
        elif roll < 0.1 and key in pinned:
            policy.unpin(key)
            pinned.discard(key)
        else:
            policy.touch([key])
            clock += 1
            last_touch[key] = clock
        assert policy.heap_size <= max(MIN_HEAP_BOUND, 2 * policy.table.evictable_count)
    assert policy.heap_rebuilds > 0
    evictable = policy.table.evictable_count
    expected = sorted((k for k in keys if k not in pinned), key=last_touch.__getitem__)
    assert policy.evict(evictable) == expected


def test_heap_stays_bounded_when_almost_everything_is_pinned() -> None:
    keys = prefix_keys(300)
    policy = LRUPolicy(1000 * CHUNK_BYTES)
    ready(policy, keys)
    for key in keys[:-1]:
        assert policy.pin(key)
    for _ in range(5_000):
        policy.touch([keys[-1]])
        assert policy.heap_size <= max(MIN_HEAP_BOUND, 2 * policy.table.evictable_count)
    assert policy.evict(1) == [keys[-1]]
