"""The offload connector inside the scheduler: lookups, loads, stores, failures, recency."""

from __future__ import annotations

from services.kvstore.request_record import RequestRecord
from services.scheduler.offload.verdict import Verdict
from services.scheduler.request import RequestStatus
from shared.kv.offload_key import OffloadKey
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, SPACE, OffloadRig, Tier
from tests.unit.scheduler.worker_double import WorkerDouble, token_at

PROMPT = list(range(100, 126))  # 26 tokens: 6 full blocks of 4, the hit cap is 25 -> 6 blocks


async def warm_tier(prompt: list[int] = PROMPT, max_tokens: int = 3) -> Tier:
    """A first run that stores the prompt's blocks; returns the tier it filled."""
    rig = OffloadRig.build()
    rig.scheduler.add_request(submit("a-warm", prompt, max_tokens=max_tokens))
    await rig.run()
    return rig.tier


def keys_of(rig: OffloadRig, rid: str, blocks: range) -> list[str]:
    request = rig.scheduler.requests[rid]
    return [SPACE.payload_key(OffloadKey(request.block_hashes[i], 0)) for i in blocks]


async def test_a_request_is_deferred_while_its_lookup_is_unanswered() -> None:
    rig = OffloadRig.build(await warm_tier())
    probes = rig.tier.probes
    rig.scheduler.add_request(submit("b", PROMPT))
    assert rig.scheduler.schedule() is None  # no verdict yet: nothing computed, nothing loaded
    assert rig.tier.probes == probes and rig.connector.stats.defers == 1
    await rig.probe()
    assert rig.tier.probes == probes + 1  # one batch for all the request's keys
    plan = rig.scheduler.schedule()
    assert plan is not None and plan.kv_loads and not plan.num_scheduled_tokens


async def test_the_load_covers_the_leading_present_run_only() -> None:
    tier = await warm_tier()
    rig = OffloadRig.build(tier)
    rig.scheduler.add_request(submit("b", PROMPT))
    del tier.payloads[keys_of(rig, "b", range(3, 4))[0]]  # block 3 missing; 4 and 5 present
    await rig.probe()
    plan = rig.scheduler.schedule()
    assert plan is not None and len(plan.kv_loads) == 1
    load = plan.kv_loads[0]
    assert load.request_id == "b" and load.keys == keys_of(rig, "b", range(0, 3))
    assert list(load.groups) == [0, 0, 0]
    assert list(load.block_ids) == rig.scheduler.kv.get_block_ids("b")[0]


async def test_no_compute_before_the_load_is_done_then_loaded_blocks_count_as_computed() -> None:
    rig = OffloadRig.build(await warm_tier())
    rig.scheduler.add_request(submit("b", PROMPT, max_tokens=3))
    await rig.probe()
    load_plan = rig.step()
    assert load_plan is not None and load_plan.kv_loads
    for _ in range(3):  # unanswered: the request is in no queue and computes nothing
        assert rig.scheduler.schedule() is None
    assert rig.scheduler.requests["b"].status is RequestStatus.WAITING
    rig.answer_loads(load_plan)
    plan = rig.step()
    assert plan is not None
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 24  # 6 loaded blocks; the double checked their tokens
    assert plan.num_scheduled_tokens == {"b": 2}
    await rig.run()
    assert rig.client.outputs["b"] == [token_at("b", 26 + i) for i in range(3)]
    assert rig.connector.stats.external_hit_tokens == 24


async def test_a_failed_load_recomputes_and_its_keys_become_misses() -> None:
    rig = OffloadRig.build(await warm_tier())
    rig.scheduler.add_request(submit("b", PROMPT, max_tokens=2))
    await rig.probe()
    load_plan = rig.step()
    assert load_plan is not None
    bad = keys_of(rig, "b", range(2, 3))
    free_before_answer = rig.scheduler.kv.num_free_blocks
    rig.answer_loads(load_plan, fail=set(bad))
    assert rig.scheduler.kv.num_free_blocks == free_before_answer + 6  # blocks freed
    assert rig.lookup.lookup("b", SPACE.parse(bad[0])) is Verdict.MISS  # forced miss sticks
    plan = rig.step()
    assert plan is not None  # a shorter load: the run before the failed key
    assert plan.kv_loads[0].keys == keys_of(rig, "b", range(0, 2))
    rig.answer_loads(plan)
    plan = rig.step()
    assert plan is not None and plan.new_requests[0].num_computed_tokens == 8
    await rig.run()
    assert rig.client.outputs["b"] == [token_at("b", 26), token_at("b", 27)]


async def test_a_worker_reset_voids_loads_and_frees_their_blocks() -> None:
    rig = OffloadRig.build(await warm_tier())
    rig.scheduler.add_request(submit("b", PROMPT, max_tokens=2))
    await rig.probe()
    load_plan = rig.step()
    assert load_plan is not None
    rig.scheduler.reset_worker_state("w1")
    assert rig.scheduler.kv.num_free_blocks == rig.scheduler.kv.num_usable_blocks
    rig.answer_loads(load_plan)  # a late answer for a void load is ignored
    assert rig.scheduler.kv.num_free_blocks == rig.scheduler.kv.num_usable_blocks
    rig.worker = rig.transfers.worker = WorkerDouble(BLOCK, incarnation="w1")
    await rig.run()
    assert rig.client.outputs["b"] == [token_at("b", 26), token_at("b", 27)]


async def test_an_abort_during_a_load_keeps_its_blocks_until_the_answer() -> None:
    rig = OffloadRig.build(await warm_tier())
    rig.scheduler.add_request(submit("b", PROMPT))
    await rig.probe()
    load_plan = rig.step()
    assert load_plan is not None
    free = rig.scheduler.kv.num_free_blocks
    assert rig.scheduler.abort_request("b") is not None
    assert rig.connector.take_finished() == ["b"]  # the kvstore record is committed (pins go)
    assert rig.scheduler.kv.num_free_blocks == free  # the worker may still write into them
    rig.answer_loads(load_plan)
    assert rig.scheduler.kv.num_free_blocks == rig.scheduler.kv.num_usable_blocks
    assert not rig.scheduler.has_work()


async def test_finish_and_failure_report_the_request_to_the_tier() -> None:
    rig = OffloadRig.build(await warm_tier(), max_step_failures=1)
    rig.scheduler.add_request(submit("b", PROMPT, max_tokens=1))
    rig.scheduler.add_request(submit("c", [7] * 9, max_tokens=4))
    await rig.probe()
    load_plan = rig.step()
    assert load_plan is not None
    rig.answer_loads(load_plan)
    plan = rig.scheduler.schedule()
    assert plan is not None and set(plan.num_scheduled_tokens) == {"b", "c"}
    rig.scheduler.step_failed(plan, "boom")  # max_step_failures=1: both finish with "error"
    assert sorted(rig.connector.take_finished()) == ["b", "c"]
    assert rig.scheduler.kv.num_free_blocks == rig.scheduler.kv.num_usable_blocks


async def test_stores_offer_only_complete_blocks_each_once() -> None:
    rig = OffloadRig.build(max_num_batched_tokens=10)
    rig.scheduler.add_request(submit("a", list(range(100, 122)), max_tokens=6))  # 22 tokens
    offered: list[str] = []
    ends: list[int] = []
    while rig.scheduler.has_work():
        await rig.probe()
        plan = rig.step()
        assert plan is not None
        request = rig.scheduler.requests.get("a")
        for t in plan.kv_stores:
            offered += t.keys
            for block_id in t.block_ids:  # complete after this step (checked by the double)
                assert block_id in rig.worker.held["a"].block_ids
        if request is not None:
            ends.append(len(offered) * BLOCK)
            # never past the verified tokens computed by now
            assert len(offered) * BLOCK <= min(request.num_computed_tokens, request.num_tokens)
    assert len(offered) == len(set(offered)) == 6  # 22 prompt + 5 fed back = 27 -> 6 blocks
    assert ends[:3] == [8, 20, 20]  # chunks of 10: blocks full at 8, 20 (22 not a boundary)


async def test_recorded_keys_order_the_request_tail_first_head_last() -> None:
    rig = OffloadRig.build(await warm_tier())
    rig.scheduler.add_request(submit("a", PROMPT[:5], max_tokens=1))
    await rig.run()  # block 0 is now a LOCAL hit (cached, free)
    rig.scheduler.add_request(submit("b", [*PROMPT, *range(500, 508)], max_tokens=4))
    await rig.probe()
    rig.connector.take_store_offers()  # a's
    load_plan = rig.step()
    assert load_plan is not None
    (load,) = load_plan.kv_loads
    assert load.keys == keys_of(rig, "b", range(1, 6))  # after the local hit
    # The local hit is offered with the load: a wrote it, so it is only recorded (not written).
    (offer,) = rig.connector.take_store_offers()
    assert not load_plan.kv_stores and not offer.write
    assert [SPACE.payload_key(k) for k, _ in offer.record] == keys_of(rig, "b", range(0, 1))
    rig.answer_loads(load_plan)
    assert rig.step() is not None  # computes 24..34: blocks 6 and 7 complete
    record = RequestRecord("b")
    state = rig.connector.states["b"]
    for key, end in state.loaded:  # what the kvstore records from the connector's calls
        record.was_read(key, end)
    for key, end in state.offered:
        record.offered(key, end)
    order = record.access_order()
    assert [record.positions[k] for k in order] == [32, 28, 24, 20, 16, 12, 8, 4]
    assert order[-1] == OffloadKey(rig.scheduler.requests["b"].block_hashes[0], 0)
