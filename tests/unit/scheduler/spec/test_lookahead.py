"""Scheduler side of speculative decoding: lookahead slots, rollback, caps, verified-only
prefix caching, acceptance stats. Driven plan by plan with hand-made worker results."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector
from services.scheduler.pd import PrefillPolicy
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.spec import lookahead_of, prefill_lookahead_tokens, retained_tokens
from shared.config import SchedulerSettings
from shared.kv.groups import KVGroupSpec
from shared.kv.offload_key import KeySpace
from shared.protocol import (
    SampledTokens,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerReady,
)

BLOCK = 4


def make(num_spec_tokens: int = 3, max_model_len: int = 64) -> Scheduler:
    config = SchedulerConfig(
        block_size=BLOCK,
        num_gpu_blocks=64,
        max_model_len=max_model_len,
        num_spec_tokens=num_spec_tokens,
    )
    return Scheduler(config, "s")


def submit(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 20) -> None:
    msg = SubmitRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_stream="r",
    )
    assert s.add_request(msg) is None


def result(plan: StepPlan, rid: str, tokens: list[int], drafts: list[int] | None) -> StepResult:
    sampled = SampledTokens(request_id=rid, token_ids=tokens, draft_token_ids=drafts)
    return StepResult(step_id=plan.step_id, worker_id="w", sampled=[sampled])


def step(s: Scheduler, rid: str, tokens: list[int], drafts: list[int] | None) -> StepPlan:
    plan = s.schedule()
    assert plan is not None
    s.update_from_output(plan, result(plan, rid, tokens, drafts))
    return plan


def test_drafts_get_lookahead_slots_and_rejected_ones_roll_back() -> None:
    s = make()
    prompt = [10, 11, 12, 13, 14, 15]
    submit(s, "a", prompt)
    step(s, "a", [100], [101, 102, 103, 104])  # prefill; 4 drafts proposed, K = 3
    request = s.get_request("a")
    assert request is not None

    free = s.kv.num_free_blocks
    estimate = s.kv.estimate_blocks_to_allocate(request, 1 + 3)
    plan = s.schedule()
    assert plan is not None
    assert plan.spec_token_ids == {"a": [101, 102, 103]}
    assert plan.num_scheduled_tokens == {"a": 4}  # last verified token + 3 drafts
    assert free - s.kv.num_free_blocks == estimate  # admission estimate == allocation
    assert len(s.kv.get_block_ids("a")[0]) * BLOCK >= request.num_tokens + 3  # lookahead

    s.update_from_output(plan, result(plan, "a", [101, 102, 200], [7]))  # 2 of 3 accepted
    assert request.output_token_ids == [100, 101, 102, 200]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9
    stats = s.spec.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.accepted_per_pos == [1, 1, 0]

    plan = s.schedule()  # the next step starts from the rolled-back position
    assert plan is not None
    assert plan.cached_requests[0].num_computed_tokens == 9
    assert plan.num_scheduled_tokens == {"a": 2} and plan.spec_token_ids == {"a": [7]}


def cached_prefix(s: Scheduler, tokens: list[int]) -> int:
    """Tokens of `tokens` a new request would find in the prefix cache."""
    probe = Request("probe", tokens, SamplingParams(), "r", BLOCK)
    return s.kv.get_computed_blocks(probe)[1]


def test_only_verified_tokens_reach_the_prefix_cache() -> None:
    s = make()
    prompt = [10, 11, 12, 13, 14]
    submit(s, "a", prompt)
    step(s, "a", [100], [50, 51, 52])
    # Drafts 50, 51 would complete block 1 (positions 4..7); both are rejected.
    step(s, "a", [300], [60, 61])
    assert cached_prefix(s, [*prompt, 100, 50, 51, 9]) == BLOCK  # block 1 never cached
    step(s, "a", [60, 61, 62], [])  # accepted drafts complete block 1 (14, 100, 300, 60)
    assert cached_prefix(s, [*prompt, 100, 300, 5, 9]) == BLOCK
    assert cached_prefix(s, [*prompt, 100, 300, 60, 9]) == 2 * BLOCK


def test_drafts_are_capped_by_max_tokens_and_max_model_len() -> None:
    s = make(num_spec_tokens=8)
    submit(s, "a", [10, 11, 12], max_tokens=4)
    step(s, "a", [100], [1, 2, 3, 4, 5])
    plan = step(s, "a", [1, 2, 3], [4, 5])  # 4 - 1 output - 1 bonus = 2 drafts at most
    assert plan.spec_token_ids == {"a": [1, 2]}

    s = make(num_spec_tokens=8, max_model_len=12)
    submit(s, "b", [10, 11, 12, 13, 14, 15, 16, 17], max_tokens=50)
    step(s, "b", [100], [1, 2, 3, 4, 5])
    plan = s.schedule()  # 9 tokens known; drafts + bonus must end by position 11
    assert plan is not None
    assert plan.spec_token_ids == {"b": [1, 2]}


def test_without_speculation_drafts_are_ignored() -> None:
    s = make(num_spec_tokens=0)
    submit(s, "a", [10, 11, 12])
    step(s, "a", [100], [1, 2, 3])
    plan = s.schedule()
    assert plan is not None
    assert plan.spec_token_ids == {} and plan.num_scheduled_tokens == {"a": 1}


def test_a_finished_request_leaves_no_drafts_behind() -> None:
    s = make()
    submit(s, "a", [10, 11, 12], max_tokens=2)
    step(s, "a", [100], [1, 2, 3])
    step(s, "a", [1, 2], [3])
    assert s.get_request("a") is None
    assert len(s.spec.book) == 0


def test_one_prefill_lookahead_number_is_the_max_not_the_sum() -> None:
    assert prefill_lookahead_tokens() == 0
    assert prefill_lookahead_tokens(0, 0) == 0
    assert prefill_lookahead_tokens(1, 3) == 3  # EAGLE backoff 1 with 3-module MTP: 3, not 4


def test_one_lookahead_number_drives_pd_and_sliding_window_retention() -> None:
    """The settings give one number (lookahead_of); the scheduler core's config carries it, P/D
    stops that many tokens short, and a sliding group retains max(0, lookahead - 1) tokens
    in its offload coverage. An n-gram drafter with K = 6 backs off nothing: K is not it."""
    ready = WorkerReady(
        worker_id="w", incarnation="i", model="m", num_kv_blocks=64, block_size=BLOCK,
        vocab_size=100, max_model_len=256,
        kv_groups=[KVGroupSpec(kind="sliding_window", layer_indices=[0], sliding_window=8)],
    )  # fmt: skip
    cases = [
        (SchedulerSettings(), 0, 2),
        (SchedulerSettings(spec_method="ngram", spec_tokens=6), 0, 2),
        (SchedulerSettings(spec_method="eagle", spec_tokens=6), 1, 2),
        (SchedulerSettings(spec_method="mtp", prefill_lookahead_tokens=4), 4, 3),
    ]
    for settings, lookahead, coverage in cases:
        config = SchedulerConfig.from_worker(settings, ready)
        assert config.lookahead_tokens == lookahead_of(settings) == lookahead
        assert PrefillPolicy(lookahead_of(settings), BLOCK).lookahead == lookahead
        connector = OffloadConnector(config, KeySpace("c", "m", 1), AsyncLookup(_no_tier), "t")
        (window,) = connector.windows
        assert window.spec is not None
        assert window.spec.extra_retained == retained_tokens(lookahead) == max(0, lookahead - 1)
        assert window.coverage == coverage  # window 8, block 4: max(2, cdiv(7 + r, 4))


async def _no_tier(keys: list[object]) -> dict[object, object]:
    return {}
