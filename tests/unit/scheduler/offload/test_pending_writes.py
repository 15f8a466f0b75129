"""A chunk whose write to the tier is still in flight (HIT_PENDING) while serving: the request
is asked again next step instead of recomputing the chunk or reading it half written, but only
when the chunk lies in what the hit would read (every chunk for full attention, the window run
for a sliding group), and only for a bounded time. The tier is the harness's, answering what
the kvstore answers ("writing" -> HIT_PENDING); scheduler, KV manager and lookup are real."""

from __future__ import annotations

from services.scheduler.kv.kv_cache_spec import KVCacheGroup, SlidingWindowSpec
from shared.kv.offload_key import OffloadKey
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, SPACE, OffloadRig, Tier

PROMPT = list(range(100, 126))  # 26 tokens: the hit cap is 25 -> 6 chunks


def name(rig: OffloadRig, rid: str, i: int, g: int = 0) -> str:
    return SPACE.payload_key(OffloadKey(rig.scheduler.requests[rid].block_hashes[i], g))


def fill(rig: OffloadRig, rid: str, chunks: range, g: int = 0) -> None:
    for i in chunks:
        rig.tier.payloads[name(rig, rid, i, g)] = [0] * BLOCK


async def test_full_attention_defers_on_a_write_in_flight_then_loads_it() -> None:
    rig = OffloadRig.build()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", range(6))
    rig.tier.writing.add(name(rig, "b", 3))  # chunk 3 present, its write still in flight
    free = rig.scheduler.kv.num_free_blocks
    await rig.probe()
    assert rig.scheduler.schedule() is None  # neither computed nor loaded half written
    assert rig.connector.stats.pending_defers == 1 and rig.connector.stats.defers == 0
    assert rig.scheduler.kv.num_free_blocks == free  # nothing allocated while deferred
    await rig.probe()  # asked again: still writing
    assert rig.scheduler.schedule() is None and rig.connector.stats.pending_defers == 2
    rig.tier.writing.clear()  # the write landed
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None and not plan.num_scheduled_tokens
    (load,) = plan.kv_loads
    assert load.keys == [name(rig, "b", i) for i in range(6)]


async def test_a_write_that_stays_in_flight_past_the_bound_is_recomputed() -> None:
    now = [0.0]
    rig = OffloadRig.build(clock=lambda: now[0])
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", range(6))
    rig.tier.writing.add(name(rig, "b", 3))
    await rig.probe()
    assert rig.scheduler.schedule() is None
    now[0] = 2.0  # pending 2 s since first seen writing: a miss from now on
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None
    (load,) = plan.kv_loads  # the run before the chunk that never landed
    assert load.keys == [name(rig, "b", i) for i in range(3)]
    assert rig.connector.stats.pending_defers == 1


WINDOW_GROUPS = [KVCacheGroup(spec=SlidingWindowSpec(block_size=BLOCK, sliding_window=8))]


def sliding(lookahead: int = 0, **kw: object) -> OffloadRig:
    """A sliding-window model (window 8, block 4: coverage 2 chunks, 3 with 3+ retained)."""
    return OffloadRig.build(kv_cache_groups=WINDOW_GROUPS, lookahead_tokens=lookahead, **kw)


async def test_a_pending_chunk_outside_the_window_run_does_not_defer() -> None:
    rig = sliding()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", range(6))
    rig.tier.writing.add(name(rig, "b", 2))  # before the window {4, 5}: never read
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None and rig.connector.stats.pending_defers == 0
    (load,) = plan.kv_loads
    assert load.keys == [name(rig, "b", i) for i in (4, 5)]


async def test_a_pending_chunk_in_the_window_run_defers() -> None:
    rig = sliding()
    rig.scheduler.add_request(submit("b", PROMPT))
    fill(rig, "b", range(6))
    rig.tier.writing.add(name(rig, "b", 4))
    await rig.probe()
    assert rig.scheduler.schedule() is None
    assert rig.connector.stats.pending_defers == 1
    assert rig.scheduler.requests["b"].num_computed_tokens == 0


PROMPT_17 = list(range(200, 217))  # the hit cap is 16 tokens: 4 chunks, window ending at 4


async def test_retained_tokens_widen_the_lookup_to_chunk_1() -> None:
    """CONTRACTS' case scaled to block 4: a 16-token hit, window 8, 3 tokens retained
    (lookahead 4): coverage max(cdiv(8, 4), cdiv(7 + 3, 4)) = 3 chunks, so chunk 1 counts."""
    # chunk 1 missing: the hit is refused before any allocation
    rig = sliding(lookahead=4)
    rig.scheduler.add_request(submit("b", PROMPT_17))
    fill(rig, "b", range(2, 4))
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None and not plan.kv_loads and plan.num_scheduled_tokens == {"b": 17}
    # chunk 1 being written: the lookup defers
    rig = sliding(lookahead=4)
    rig.scheduler.add_request(submit("b", PROMPT_17))
    fill(rig, "b", range(1, 4))
    rig.tier.writing.add(name(rig, "b", 1))
    await rig.probe()
    assert rig.scheduler.schedule() is None and rig.connector.stats.pending_defers == 1
    # no retention (lookahead 0 or 1): chunk 1 is outside the window, the hit loads {2, 3}
    for lookahead in (0, 1):
        rig = sliding(lookahead=lookahead)
        rig.scheduler.add_request(submit("b", PROMPT_17))
        fill(rig, "b", range(2, 4))
        await rig.probe()
        plan = rig.scheduler.schedule()
        assert plan is not None
        (load,) = plan.kv_loads
        assert load.keys == [name(rig, "b", i) for i in (2, 3)]


async def test_the_store_path_stores_the_retained_chunk() -> None:
    for lookahead, stored in ((4, [1, 2, 3]), (1, [2, 3]), (0, [2, 3])):
        rig = sliding(lookahead=lookahead)
        rig.scheduler.add_request(submit("a", PROMPT_17, max_tokens=1))
        expected = {name(rig, "a", i) for i in stored}
        await rig.run()
        assert set(rig.tier.payloads) == expected, lookahead


async def test_a_window_being_loaded_holds_only_requests_that_would_read_it() -> None:
    """Request a loads its window {4, 5}. b (same prompt) would read those very chunks: held,
    not a second load. c shares only the first 16 tokens: its hit is the window {2, 3}, which
    nobody is loading, so it loads at once (chunk 0 is in no load: the window decides)."""
    tier = Tier()
    rig = sliding(tier=tier, num_gpu_blocks=64)
    other = [*PROMPT[:16], *range(900, 910)]
    rig.scheduler.add_request(submit("a", PROMPT))
    fill(rig, "a", range(6))
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None
    (load_a,) = plan.kv_loads
    assert load_a.keys == [name(rig, "a", i) for i in (4, 5)]
    rig.scheduler.add_request(submit("b", PROMPT))
    rig.scheduler.add_request(submit("c", other))
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None
    (load_c,) = plan.kv_loads
    assert load_c.request_id == "c" and load_c.keys == [name(rig, "c", i) for i in (2, 3)]
    assert rig.connector.stats.holds == 1  # b, once
    assert rig.connector.is_loading("c") and not rig.connector.is_loading("b")
    rig.answer_loads(plan)
