"""Drafts on the worker (SchedulerConfig.spec_drafts_on_worker, on with asynchronous
scheduling): decoding requests get lookahead slots instead of drafts, verify steps are planned
before the previous result, every in-flight slot counts as accepted until its result rolls the
request back, and near max_tokens a request is planned from its results so its slots are never
cut by steps still in flight. Driven plan by plan with hand-made worker results."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.protocol import SampledTokens, SamplingParams, StepPlan, StepResult, SubmitRequest

BLOCK = 4
K = 3
PROMPT = [10, 11, 12, 13, 14, 15]


def make(max_model_len: int = 64) -> Scheduler:
    config = SchedulerConfig(
        block_size=BLOCK,
        num_gpu_blocks=64,
        max_model_len=max_model_len,
        num_spec_tokens=K,
        spec_drafts_on_worker=True,
    )
    return Scheduler(config, "s")


def submit(s: Scheduler, rid: str = "a", max_tokens: int = 20) -> Request:
    msg = SubmitRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_stream="r",
    )
    assert s.add_request(msg) is None
    request = s.get_request(rid)
    assert request is not None
    return request


def result(plan: StepPlan, tokens: list[int], num_drafts: int = 0, rid: str = "a") -> StepResult:
    sampled = SampledTokens(request_id=rid, token_ids=tokens, num_drafts=num_drafts)
    return StepResult(step_id=plan.step_id, worker_id="w", sampled=[sampled])


def plan_of(s: Scheduler) -> StepPlan:
    plan = s.schedule()
    assert plan is not None
    return plan


def test_verify_steps_are_planned_ahead_and_rolled_back_by_their_results() -> None:
    s = make()
    request = submit(s)
    prefill = plan_of(s)
    assert prefill.spec_lookahead == {}  # a prompt has no drafts yet
    assert s.can_pipeline()  # drafts never pass through the scheduler

    first = plan_of(s)  # planned while the prefill is in flight
    assert first.spec_lookahead == {"a": K} and first.spec_token_ids == {}
    assert first.num_scheduled_tokens == {"a": 1 + K}
    assert request.num_output_placeholders == 1 + 1 + K  # the prefill's token, then 1 + K
    second = plan_of(s)  # and the next one, counting the first's slots as accepted
    assert second.num_scheduled_tokens == {"a": 1 + K}
    assert second.cached_requests[0].num_computed_tokens == len(PROMPT) + K + 1
    assert len(s.kv.get_block_ids("a")[0]) * BLOCK >= len(PROMPT) + 2 * (1 + K)

    s.update_from_output(prefill, result(prefill, [100]))
    s.update_from_output(first, result(first, [101, 102], num_drafts=2))  # 1 of 2 accepted
    assert request.output_token_ids == [100, 101, 102]
    # verified: the prompt, 100 and 101 (102 is the correction, computed by the next step);
    # the second step's 1 + K slots are still counted
    assert request.num_computed_tokens == len(PROMPT) + 2 + (1 + K)
    assert request.num_output_placeholders == 1 + K
    assert (s.spec.stats.num_draft_tokens, s.spec.stats.num_accepted_tokens) == (2, 1)

    s.update_from_output(second, result(second, [103, 104, 105, 106], num_drafts=3))
    assert request.output_token_ids == [100, 101, 102, 103, 104, 105, 106]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert request.num_output_placeholders == 0
    assert s.spec.stats.num_accepted_tokens == 1 + 3


def test_a_step_with_no_drafts_leaves_its_slots_unused() -> None:
    s = make()
    request = submit(s)
    prefill = plan_of(s)
    s.update_from_output(prefill, result(prefill, [100]))
    plan = plan_of(s)
    s.update_from_output(plan, result(plan, [101], num_drafts=0))  # the worker had none
    assert request.num_computed_tokens == request.num_tokens - 1
    assert s.spec.stats.num_draft_tokens == 0


def test_near_max_tokens_kv_stops_at_the_peak_and_a_skipped_request_is_no_loss() -> None:
    """The worker cuts its drafts at max_tokens by its true count and skips a request already
    there (services/worker/spec/drafts.py), so planning ahead goes on to the end; KV is
    allocated only up to the admission peak, not for every slot counted as accepted."""
    s = make()
    request = submit(s, max_tokens=6)
    peak = len(PROMPT) + 6 - 1
    plans = []
    while (plan := s.schedule()) is not None:
        plans.append(plan)
    # each step in flight gives at least one token: the prefill and five verify steps reach 6
    assert len(plans) == 1 + 5
    assert [p.spec_lookahead for p in plans[1:]] == [{"a": K}] * 5
    assert request.num_computed_tokens == len(PROMPT) + 5 * (1 + K) > peak
    assert len(s.kv.get_block_ids("a")[0]) == -(-peak // BLOCK)

    s.update_from_output(plans[0], result(plans[0], [100]))
    s.update_from_output(plans[1], result(plans[1], [101, 102, 103, 104], num_drafts=K))
    s.update_from_output(plans[2], result(plans[2], [105]))  # no room left for a draft
    assert request.status.is_finished and request.output_token_ids == [100, 101, 102, 103, 104, 105]
    for plan in plans[3:]:  # skipped by the worker: nothing recomputed
        out = s.update_from_output(plan, StepResult(step_id=plan.step_id, worker_id="w"))
        assert not out.deltas and not s.waiting


def test_a_sliding_window_model_keeps_drafts_in_the_plans() -> None:
    """A window drops blocks by num_computed_tokens, which runs ahead of the worker's count
    while lookahead slots are in flight: such a model's drafts go through the scheduler."""
    config = SchedulerConfig(
        block_size=BLOCK,
        num_gpu_blocks=64,
        num_spec_tokens=K,
        spec_drafts_on_worker=True,
        kv_cache_groups=[
            KVCacheGroup(spec=FullAttentionSpec(block_size=BLOCK)),
            KVCacheGroup(spec=SlidingWindowSpec(block_size=BLOCK, sliding_window=8)),
        ],
    )
    s = Scheduler(config, "s")
    submit(s)
    prefill = plan_of(s)
    assert not s.can_pipeline()
    sampled = SampledTokens(request_id="a", token_ids=[100], draft_token_ids=[101, 102])
    s.update_from_output(
        prefill, StepResult(step_id=prefill.step_id, worker_id="w", sampled=[sampled])
    )
    plan = plan_of(s)
    assert plan.spec_lookahead == {} and plan.spec_token_ids == {"a": [101, 102]}
