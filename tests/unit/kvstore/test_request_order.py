"""Recency is committed once per request: eviction follows the request, not the transfers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.kvstore.chunk_table import Key
from services.kvstore.lru import LRUPolicy
from services.kvstore.offload_tier import ChunkOffer, OffloadTier
from services.kvstore.policy import EvictionOrderPolicy, OffloadPolicy, load_policy
from services.kvstore.request_record import RequestRecord
from tests.unit.kvstore.prefix import prefix_chunks

NBYTES = 100

ORDERS = {
    "head_first": [0, 1, 2, 3],
    "head_last": [3, 2, 1, 0],
    "mixed": [2, 0, 3, 1],
}


def offers(chunks, order: Sequence[int]) -> list[ChunkOffer]:
    return [ChunkOffer(chunks[i][0], chunks[i][1], NBYTES) for i in order]


@pytest.mark.parametrize("offer_order", ORDERS.values(), ids=ORDERS.keys())
@pytest.mark.parametrize("completion_order", ORDERS.values(), ids=ORDERS.keys())
def test_eviction_takes_tail_before_head_whatever_the_transfer_order(
    offer_order: list[int], completion_order: list[int]
) -> None:
    chunks = prefix_chunks(4)
    keys = [k for k, _ in chunks]
    tier = OffloadTier(LRUPolicy(100 * NBYTES))
    plan = tier.store("r1", offers(chunks, offer_order))
    assert sorted(plan.write) == sorted(keys)
    for i in completion_order:
        assert tier.stored([keys[i]], ok=True) == [keys[i]]
    tier.request_finished("r1")
    assert tier.policy.evict(4) == list(reversed(keys))


def test_loads_and_stores_of_one_request_form_one_access() -> None:
    chunks = prefix_chunks(4)
    keys = [k for k, _ in chunks]
    other = prefix_chunks(2, seed=1)
    tier = OffloadTier(LRUPolicy(100 * NBYTES))
    # The head (chunks 0-1) was stored by an earlier request; then unrelated chunks arrive.
    tier.store("r0", offers(chunks, [0, 1]))
    tier.stored(keys[:2], ok=True)
    tier.request_finished("r0")
    tier.store("x", [ChunkOffer(k, e, NBYTES) for k, e in other])
    tier.stored([k for k, _ in other], ok=True)
    tier.request_finished("x")
    # r1 reads the head (pins, then releases it mid-request) and stores the tail.
    assert tier.load("r1", [chunks[1], chunks[0]]) == [keys[1], keys[0]]
    assert tier.loaded("r1", keys[:2]) == 2
    tier.store("r1", offers(chunks, [3, 2]))
    tier.stored([keys[2], keys[3]], ok=True)
    record = tier.request_finished("r1")
    assert record is not None
    assert record.reused == set(keys[:2]) and record.inserted == set(keys[2:])
    # The unrelated prefix first (tail to head), then r1's prefix tail to head.
    assert tier.policy.evict(6) == [k for k, _ in reversed(other)] + list(reversed(keys))


def test_hybrid_groups_lose_every_tail_before_any_head() -> None:
    full = prefix_chunks(4, group=0)
    window = prefix_chunks(4, group=1)[2:]  # a sliding-window group keeps only its last chunks
    tier = OffloadTier(LRUPolicy(100 * NBYTES))
    all_chunks = full + window
    tier.store("r1", [ChunkOffer(k, e, NBYTES) for k, e in all_chunks])
    # Completion: window group first, full group head first.
    tier.stored([k for k, _ in window] + [k for k, _ in full], ok=True)
    tier.request_finished("r1")
    end_of = dict(all_chunks)
    evicted = tier.policy.evict(len(all_chunks))
    assert evicted is not None
    ends = [end_of[k] for k in evicted]
    assert ends == sorted(ends, reverse=True)  # 64, 64, 48, 48, 32, 16
    assert set(evicted[:2]) == {full[3][0], window[1][0]}


def test_store_miss_hook_runs_once_per_key_per_request_before_insertion() -> None:
    class MissLog(LRUPolicy):
        def __init__(self, capacity_bytes: int) -> None:
            super().__init__(capacity_bytes)
            self.misses: list[tuple[Key, bool]] = []

        def on_store_miss(self, key: Key) -> None:
            self.misses.append((key, key in self.table))

    chunks = prefix_chunks(3)
    keys = [k for k, _ in chunks]
    policy = MissLog(2 * NBYTES)
    tier = OffloadTier(policy)
    plan = tier.store("r1", offers(chunks, [0, 1, 2]))
    # Chunks 0 and 1 fit; 2 cannot (the request's own head is never evicted for its tail).
    assert plan.write == keys[:2] and plan.refused == [keys[2]]
    tier.store("r1", offers(chunks, [0, 1, 2]))  # offered again in the same request
    assert policy.misses == [(k, False) for k in keys]  # once each, each before insertion
    record = tier.records["r1"]
    assert record.store_misses == set(keys) and record.inserted == set(keys[:2])
    tier.store("r2", offers(chunks, [2]))
    assert policy.misses[-1] == (keys[2], False)  # a new request misses again


def test_internal_moves_are_not_accesses() -> None:
    ((a, a_end),) = prefix_chunks(1, seed=3)
    ((b, b_end),) = prefix_chunks(1, seed=4)
    tier = OffloadTier(LRUPolicy(100 * NBYTES))
    for request, key, end in (("w1", a, a_end), ("w2", b, b_end)):
        tier.store(request, [ChunkOffer(key, end, NBYTES)])
        tier.stored([key], ok=True)
        tier.request_finished(request)  # b is the more recent
    order_before = tier.policy.rank.copy()
    assert tier.load("move-1", [(a, a_end)], internal=True) == [a]
    assert tier.loaded("move-1", [a]) == 1
    assert tier.request_finished("move-1") is None
    assert tier.policy.rank == order_before
    assert tier.load("r2", [(a, a_end)]) == [a]  # a request's read is an access
    tier.request_finished("r2")
    assert tier.policy.evict(1) == [b]


def test_pins_are_counted_per_holder_and_released_at_finish() -> None:
    ((a, end),) = prefix_chunks(1)
    tier = OffloadTier(LRUPolicy(100 * NBYTES))
    tier.store("w", [ChunkOffer(a, end, NBYTES)])
    tier.stored([a], ok=True)
    assert tier.load("r1", [(a, end)]) == [a]
    assert tier.load("r2", [(a, end)]) == [a]
    assert tier.loaded("r1", [a]) == 1
    assert tier.loaded("r1", [a]) == 0  # a retried report never releases r2's pin
    assert tier.policy.evict(1) is None
    tier.request_finished("r2")  # r2 never reported its read: the finish releases it
    assert tier.policy.evict(1) == [a]


def test_loads_of_absent_or_writing_chunks_pin_nothing() -> None:
    (a, a_end), (b, b_end) = prefix_chunks(2)
    tier = OffloadTier(LRUPolicy(100 * NBYTES))
    tier.store("w", [ChunkOffer(a, a_end, NBYTES)])
    assert tier.load("r1", [(a, a_end), (b, b_end)]) == []
    assert tier.request_finished("r1").reused == set()  # type: ignore[union-attr]


class RecencyList(EvictionOrderPolicy):
    """A policy written with `touch` only (plus its eviction order): no request hooks."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.recent: dict[Key, None] = {}
        self.touches: list[list[Key]] = []

    def touch(self, keys: Sequence[Key]) -> None:
        self.touches.append(list(keys))
        for key in keys:
            self.recent.pop(key, None)
            self.recent[key] = None

    def eviction_order(self) -> Sequence[Key]:
        untouched = [k for k in self.table if k not in self.recent]
        return [*untouched, *(k for k in self.recent if k in self.table)]


def test_a_touch_only_policy_still_works() -> None:
    chunks = prefix_chunks(4)
    keys = [k for k, _ in chunks]
    policy = RecencyList(100 * NBYTES)
    tier = OffloadTier(policy)
    tier.store("r1", offers(chunks, [0, 1, 2, 3]))
    tier.stored(keys, ok=True)
    tier.request_finished("r1")
    assert policy.touches == [list(reversed(keys))]  # one access, tail first
    assert policy.evict(5) is None and len(policy.table) == 4
    assert policy.evict(2, protected={keys[3]}) == [keys[2], keys[1]]


def test_default_on_request_finished_calls_touch_with_the_access_order() -> None:
    record = RequestRecord("r")
    for k, end in prefix_chunks(3):
        record.offered(k, end)
    policy = RecencyList(1000)
    policy.on_request_finished(record)
    assert policy.touches == [record.access_order()]


def test_policies_load_by_module_path() -> None:
    policy = load_policy("services.kvstore.lru.LRUPolicy", 1234)
    assert isinstance(policy, LRUPolicy) and policy.capacity_bytes == 1234
    assert isinstance(load_policy(f"{__name__}.RecencyList", 10), OffloadPolicy)
    for bad in ("LRUPolicy", "services.kvstore.lru.Nope", "services.nope.X", "builtins.dict"):
        with pytest.raises(ValueError, match="policy"):
            load_policy(bad, 10)


def test_writes_never_reported_expire_and_free_their_bytes() -> None:
    (a, a_end), (b, b_end) = prefix_chunks(2)
    tier = OffloadTier(LRUPolicy(2 * NBYTES))
    tier.store("r1", [ChunkOffer(a, a_end, NBYTES)], now=10.0)
    tier.store("r2", [ChunkOffer(b, b_end, NBYTES)], now=50.0)
    assert tier.expire_writes(now=60.0, max_age=30.0) == [a]
    assert tier.policy.status(a) is None and tier.policy.table.used_bytes == NBYTES
    assert tier.stored([a], ok=True) == []  # the late report of the dead writer is ignored
    assert tier.stored([b], ok=True) == [b]
    assert tier.expire_writes(now=1000.0, max_age=30.0) == []
