"""Prefill/decode disaggregation in the scheduler core, over one offload tier (CONTRACTS.md,
"One prefill-lookahead number"): a prefill-role scheduler runs the request's prefill job
against its WorkerDouble, stores its blocks in the tier; a decode-role scheduler (its own
WorkerDouble: its own KV) loads them, prefills the rest and decodes.
"""

from __future__ import annotations

import pytest

from services.scheduler.offload.connector import OffloadConnector
from services.scheduler.offload.store_admission import StoreAdmission
from services.scheduler.pd import HandoffBook, PrefillPolicy, prefilled_in_step
from services.scheduler.request import RequestStatus
from services.scheduler.spec import lookahead_of
from shared.config import SchedulerSettings
from shared.kv.block_hash import extend_block_hashes
from shared.kv.offload_key import OffloadKey
from shared.protocol import SubmitRequest
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, SPACE, OffloadRig, Tier, config
from tests.unit.scheduler.worker_double import token_at

PROMPT = list(range(100, 135))  # 35 tokens: with N = 3 the prefill side computes 32 = 8 blocks


def prompt_keys(prompt: list[int], num_tokens: int) -> set[str]:
    """Payload keys of the full blocks of `prompt[:num_tokens]`."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt[:num_tokens], BLOCK)
    return {SPACE.payload_key(OffloadKey(h, 0)) for h in hashes}


async def run_prefill(
    msg: SubmitRequest, lookahead: int, tier: Tier | None = None
) -> tuple[OffloadRig, int]:
    """The prefill side until its job is done; returns the rig and the tokens it scheduled."""
    rig = OffloadRig.build(tier)
    rig.scheduler.prefill_only = True
    job = PrefillPolicy(lookahead, BLOCK).job_for(msg)
    assert job is not None
    rig.scheduler.add_request(job)
    scheduled = 0
    for _ in range(100):
        await rig.probe()
        plan = rig.step()
        assert plan is not None, "the job stalled before it was prefilled"
        rig.answer_loads(plan)
        scheduled += plan.num_scheduled_tokens.get(msg.request_id, 0)
        totals = {msg.request_id: len(job.prompt_token_ids)}
        if prefilled_in_step(plan, totals):
            return rig, scheduled
    raise AssertionError("never prefilled")


@pytest.mark.parametrize(("lookahead", "computed"), [(3, 32), (1, 34), (0, 34)])
async def test_the_prefill_role_schedules_prompt_len_minus_n(lookahead: int, computed: int) -> None:
    rig, scheduled = await run_prefill(submit("a", PROMPT, max_tokens=5), lookahead)
    assert scheduled == computed == len(PROMPT) - max(1, lookahead)
    request = rig.scheduler.requests["a"]
    assert request.num_computed_tokens == computed and request.num_output_tokens == 0
    assert rig.client.outputs == {}  # no delta: the decode side answers the client
    # Only full blocks of the computed prompt part reach the tier (34 tokens: 8 blocks).
    assert set(rig.tier.payloads) == prompt_keys(PROMPT, computed)
    assert rig.scheduler.schedule() is None  # nothing left to compute, nothing sampled
    assert rig.scheduler.release_prefilled("a")
    assert not rig.scheduler.has_work()
    assert rig.scheduler.kv.num_free_blocks == rig.scheduler.kv.num_usable_blocks


async def test_decode_role_with_a_full_remote_hit_prefills_the_last_n_before_decoding() -> None:
    msg = submit("a", PROMPT, max_tokens=4)
    prefill, _ = await run_prefill(msg, lookahead=3)
    stored = dict(prefill.tier.payloads)
    decode = OffloadRig.build(prefill.tier)
    decode.scheduler.offload = OffloadConnector(
        decode.scheduler.config, SPACE, decode.lookup, "d", store=False
    )
    decode.scheduler.add_request(msg)  # the original request, handed off
    await decode.probe()
    load_plan = decode.step()
    assert load_plan is not None and not load_plan.num_scheduled_tokens
    (load,) = load_plan.kv_loads
    assert set(load.keys) == prompt_keys(PROMPT, 32)  # the whole prefill part
    decode.answer_loads(load_plan)
    first = decode.step()
    assert first is not None
    (new,) = first.new_requests
    assert new.num_computed_tokens == 32
    assert first.num_scheduled_tokens == {"a": 3}  # the last N prompt tokens, then it samples
    assert decode.client.outputs["a"] == [token_at("a", 35)]
    await decode.run()
    # Greedy output as a standalone scheduler would give it (the double's tokens by position).
    assert decode.client.outputs["a"] == [token_at("a", 35 + i) for i in range(4)]
    assert decode.client.first["a"].start_index == 0
    assert all(not plan.kv_stores for plan in decode.plans)  # a KV consumer stores nothing
    assert decode.tier.payloads == stored
    assert decode.connector.stats.external_hit_tokens == 32


async def test_a_prefill_job_hits_at_most_its_own_tokens_minus_one() -> None:
    """A second request with the same prompt on the prefill side still computes one token of
    its job (a hit is capped at the job's last token), so its step offers the blocks too."""
    rig, _ = await run_prefill(submit("a", PROMPT), lookahead=3)
    job = PrefillPolicy(3, BLOCK).job_for(submit("b", PROMPT))
    assert job is not None
    rig.scheduler.add_request(job)
    await rig.probe()
    plan = rig.step()
    assert plan is not None and plan.num_scheduled_tokens["b"] >= 1
    assert prefilled_in_step(plan, {"b": 32}) == ["b"]


def test_a_prompt_without_a_full_block_to_ship_goes_to_decode_uncomputed() -> None:
    policy = PrefillPolicy(3, BLOCK)
    assert policy.job_for(submit("a", list(range(100, 106)))) is None  # 3 tokens < one block
    routed = submit("b", PROMPT).model_copy(update={"return_routed_experts": True})
    assert policy.job_for(routed) is None  # every position computed where it is decoded
    scored = submit("b", PROMPT)
    scored.sampling.prompt_logprobs = 1
    assert policy.job_for(scored) is None  # prompt logprobs too
    job = policy.job_for(submit("c", list(range(100, 107)), max_tokens=9))
    assert job is not None and job.prompt_token_ids == list(range(100, 104))
    assert job.sampling.max_tokens == 1 and job.grammar is None


async def test_store_offers_never_include_draft_positions() -> None:
    """A decoding request verifying 3 drafts gets lookahead slots past its known tokens; the
    plan's store offers stop at its known (verified) tokens' full blocks."""
    rig = OffloadRig.build()
    rig.scheduler = type(rig.scheduler)(config(num_spec_tokens=3), "s")
    rig.scheduler.offload = OffloadConnector(
        rig.scheduler.config, SPACE, rig.lookup, "t", store_admission=StoreAdmission("always")
    )
    rig.scheduler.add_request(submit("a", list(range(100, 108)), max_tokens=10))
    await rig.probe()  # an empty tier: misses, so the request computes
    prefill = rig.scheduler.schedule()
    assert prefill is not None
    rig.scheduler.update_from_output(prefill, rig.worker.run(prefill))
    request = rig.scheduler.requests["a"]
    assert request.num_tokens == 9 and len(request.block_hashes) == 2
    rig.scheduler.spec.book.put("a", [7, 8, 9])
    plan = rig.scheduler.schedule()
    assert plan is not None and plan.spec_token_ids == {"a": [7, 8, 9]}
    assert plan.num_scheduled_tokens == {"a": 4}  # position 8 and drafts at 9, 10, 11
    assert request.num_computed_tokens == 12  # slots through a block of drafts
    offered = {key for t in [*prefill.kv_stores, *plan.kv_stores] for key in t.keys}
    # Block 2 (positions 8..11) holds draft KV: it is never offered; blocks 0-1 were, once.
    assert offered == prompt_keys(request.all_token_ids, 8)
    assert not plan.kv_stores


def test_the_handoff_waits_for_every_store_answer_or_the_deadline() -> None:
    book = HandoffBook(max_wait_s=30.0)
    pending = {"a", "b"}
    book.add("a", now=0.0)
    book.add("b", now=0.0)
    book.add("a", now=5.0)  # booked again (a redelivered result): the first time counts
    assert book.take_ready(pending.__contains__, now=1.0) == []
    pending.discard("b")
    assert book.take_ready(pending.__contains__, now=2.0) == ["b"]
    assert book.take_ready(pending.__contains__, now=29.0) == []
    assert book.take_ready(pending.__contains__, now=30.0) == ["a"]  # an answer never came
    assert len(book) == 0


async def test_a_reset_prefill_request_is_not_released_until_recomputed() -> None:
    rig, _ = await run_prefill(submit("a", PROMPT), lookahead=3)
    rig.scheduler.reset_worker_state("w1")
    assert rig.scheduler.requests["a"].status is RequestStatus.PREEMPTED
    assert not rig.scheduler.release_prefilled("a")


def test_the_lookahead_is_the_max_of_what_applies() -> None:
    assert lookahead_of(SchedulerSettings()) == 0
    for method in ("eagle", "eagle3", "mtp"):  # every drafter fed the target's features
        assert lookahead_of(SchedulerSettings(spec_method=method)) == 1
    for method in ("ngram", "draft"):
        assert lookahead_of(SchedulerSettings(spec_method=method)) == 0
    assert lookahead_of(SchedulerSettings(spec_method="eagle", prefill_lookahead_tokens=3)) == 3
    assert lookahead_of(SchedulerSettings(spec_method="ngram", prefill_lookahead_tokens=2)) == 2
