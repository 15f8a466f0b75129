"""What a group tells the gateways about its prefix cache: the block pool's event log, and the
KVEvents batches and snapshots built from it."""

from __future__ import annotations

from services.gateway.route.kv_index import KVIndex
from services.scheduler.kv.block_pool import BlockPool
from services.scheduler.kv_report import KVReport
from shared.kv.block_hash import extend_block_hashes
from shared.protocol.kv_events import unpack_hashes

BS = 4


def prefix_hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS)
    return out


def test_the_log_reports_stored_and_evicted_blocks_of_group_0() -> None:
    pool = BlockPool(4)
    hashes = prefix_hashes(list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, group_id=0)
    pool.cache_full_blocks(blocks[:1], hashes[:1], group_id=1)  # not reported
    assert pool.events.take() == (hashes, [], False)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(2)  # evicts the tail first: blocks 2 and 1
    stored, removed, cleared = pool.events.take()
    assert stored == [] and sorted(removed) == sorted(hashes[1:]) and not cleared
    assert pool.reported_hashes() == hashes[:1]


def test_a_block_stored_then_evicted_in_one_batch_is_reported_removed() -> None:
    pool = BlockPool(2)
    (h,) = prefix_hashes([1, 2, 3, 4])
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [h], 0)
    pool.free_blocks([block])
    pool.get_new_blocks(1)
    assert pool.events.take() == ([], [h], False)


def test_report_snapshots_first_then_batches_then_after_a_reset() -> None:
    pool = BlockPool(8)
    report = KVReport("3", "scheduler-3", "inc", snapshot_interval_s=10)
    hashes = prefix_hashes(list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes, 0)
    first = report.due(pool, BS, now=0.0)
    assert first is not None and first.snapshot and unpack_hashes(first.stored) == hashes
    assert report.due(pool, BS, now=1.0) is None  # nothing changed
    pool.free_blocks(reversed(blocks))
    more = prefix_hashes(list(range(8, 16)))
    taken = pool.get_new_blocks(1)
    pool.cache_full_blocks(taken, more[:1], 0)
    batch = report.due(pool, BS, now=2.0)
    assert batch is not None and not batch.snapshot and unpack_hashes(batch.stored) == more[:1]
    # A gateway that applies both knows what the pool holds.
    index = KVIndex()
    index.apply(first)
    index.apply(batch)
    assert index.num_blocks("3") == len(pool.reported_hashes())
    pool.free_blocks(taken)  # nothing in use: the cache may be reset (a new worker)
    pool.reset_prefix_cache()
    after = report.due(pool, BS, now=3.0)
    assert after is not None and after.snapshot and after.stored == b""
    assert report.due(pool, BS, now=13.5) is not None  # the periodic snapshot
