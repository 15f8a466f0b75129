"""The offload connector with a hybrid model: one full-attention group + one sliding window.

Block 4, window 8: a hit at L needs the two chunks before L in the sliding group (coverage
max(cdiv(8, 4), cdiv(7, 4)) = 2) and every chunk in the full group. The scheduler and its
KVCacheManager are the real ones; the tier is the harness's dict, probed by a real AsyncLookup.
"""

from __future__ import annotations

from services.scheduler.kv.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from services.scheduler.offload.load_allocation import blocks_for_load
from shared.kv.offload_key import OffloadKey
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, SPACE, OffloadRig, Tier

PROMPT = list(range(100, 126))  # 26 tokens: the hit cap is 25 -> 6 chunks
GROUPS = [
    KVCacheGroup(spec=FullAttentionSpec(block_size=BLOCK)),
    KVCacheGroup(spec=SlidingWindowSpec(block_size=BLOCK, sliding_window=8)),
]


def hybrid(tier: Tier | None = None, **kw: object) -> OffloadRig:
    return OffloadRig.build(tier, kv_cache_groups=GROUPS, **kw)


def key(rig: OffloadRig, rid: str, i: int, g: int) -> str:
    return SPACE.payload_key(OffloadKey(rig.scheduler.requests[rid].block_hashes[i], g))


def fill(rig: OffloadRig, rid: str, full: range, sliding: range) -> None:
    """Put the request's chunks in the tier (payload content is the TransferDouble's concern)."""
    for g, chunks in ((0, full), (1, sliding)):
        for i in chunks:
            rig.tier.payloads[key(rig, rid, i, g)] = [0] * BLOCK


async def test_the_load_takes_every_full_chunk_and_only_the_window() -> None:
    rig = hybrid()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", full=range(6), sliding=range(6))
    await rig.probe()
    free = rig.scheduler.kv.num_free_blocks
    request = rig.scheduler.requests["b"]
    kv = rig.scheduler.kv
    held = rig.connector._held_for_load(kv, kv.get_computed_blocks(request)[0], 0, 6)
    estimate = blocks_for_load(kv, request, held, 0, 24)
    plan = rig.scheduler.schedule()
    assert plan is not None and not plan.num_scheduled_tokens
    (load,) = plan.kv_loads
    expected = [(i, 0) for i in range(6)]
    expected[4:] = [(4, 0), (4, 1), (5, 0), (5, 1)]  # head first, groups in order per chunk
    assert load.keys == [key(rig, "b", i, g) for i, g in expected]
    assert list(load.groups) == [g for _, g in expected]
    full_ids, window_ids = kv.get_block_ids("b")
    null = kv.pool.null_block.block_id
    assert window_ids[:4] == [null] * 4  # before the window: the null block, nothing taken
    assert list(load.block_ids) == [*full_ids[:4], full_ids[4], window_ids[4], full_ids[5],
                                    window_ids[5]]  # fmt: skip
    assert free - kv.num_free_blocks == estimate == 8  # estimate equals allocation
    assert rig.connector.stats.loads_started == 1


async def test_a_missing_window_chunk_ends_the_hit_at_the_window_before_it() -> None:
    rig = hybrid()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", full=range(6), sliding=range(2, 4))  # sliding 4, 5 missing
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None
    (load,) = plan.kv_loads
    got = sorted((rig.connector.space.parse(k).group, i) for i, k in _chunks(rig, "b", load.keys))
    assert got == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert rig.connector.states["b"].load is not None
    assert rig.connector.states["b"].load.num_tokens == 16


async def test_no_window_anywhere_computes_with_no_load() -> None:
    rig = hybrid()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", full=range(6), sliding=range(1, 2))  # chunk 0 missing: no window, no lead
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None and not plan.kv_loads and plan.num_scheduled_tokens == {"b": 26}


async def test_an_unanswered_window_chunk_defers_then_loads() -> None:
    rig = hybrid()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", full=range(6), sliding=range(6))
    await rig.probe()
    window_key = SPACE.parse(key(rig, "b", 5, 1))
    rig.lookup.invalidate([window_key])  # the tier changed: its answer is unknown again
    assert rig.scheduler.schedule() is None
    assert rig.connector.stats.defers == 1 and rig.connector.stats.loads_started == 0
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None and plan.kv_loads and key(rig, "b", 5, 1) in plan.kv_loads[0].keys


async def test_a_completed_load_resumes_with_the_window_computed() -> None:
    rig = hybrid()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", full=range(6), sliding=range(6))
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None
    (load,) = plan.kv_loads
    rig.scheduler.kv_load_done(load.transfer_id, True, [])
    plan = rig.scheduler.schedule()
    assert plan is not None
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 24 and plan.num_scheduled_tokens == {"b": 2}
    null = rig.scheduler.kv.pool.null_block.block_id
    assert list(new.block_ids[1][:4]) == [null] * 4
    # the loaded window blocks are now a local prefix hit for another request
    rig.scheduler.add_request(submit("c", PROMPT))
    blocks, num_hit = rig.scheduler.kv.get_computed_blocks(rig.scheduler.requests["c"])
    assert num_hit == 24 and [b.block_id for b in blocks[1][4:]] == list(new.block_ids[1][4:6])


async def test_stores_offer_the_window_coverage_widened_by_retained_tokens() -> None:
    for lookahead, window_from in ((0, 4), (1, 4), (3, 3)):
        rig = hybrid(lookahead_tokens=lookahead)
        rig.scheduler.add_request(submit("a", PROMPT))
        await rig.probe()
        plan = rig.scheduler.schedule()
        assert plan is not None and plan.num_scheduled_tokens == {"a": 26}
        (offer,) = plan.kv_stores
        offered = {(g, i) for g, i in _groups_chunks(rig, "a", offer.keys)}
        # lookahead 3 retains 2 tokens: coverage max(2, cdiv(7 + 2, 4)) = 3 chunks
        assert offered == {(0, i) for i in range(6)} | {(1, i) for i in range(window_from, 6)}


def _chunks(rig: OffloadRig, rid: str, names: list[str]) -> list[tuple[int, str]]:
    hashes = rig.scheduler.requests[rid].block_hashes
    return [(hashes.index(rig.connector.space.parse(n).block_hash), n) for n in names]


def _groups_chunks(rig: OffloadRig, rid: str, names: list[str]) -> list[tuple[int, int]]:
    return [(rig.connector.space.parse(n).group, i) for i, n in _chunks(rig, rid, names)]
