"""TrustedBuilder builds exactly what validated construction builds, for valid input."""

from __future__ import annotations

import pytest

from shared.codec import decode, encode
from shared.protocol import (
    CachedRequestData,
    NewRequestData,
    RequestDelta,
    SampledTokens,
    SamplingParams,
    StepPlan,
    StepResult,
)
from shared.protocol.trusted import TrustedBuilder


def test_equal_to_validated_construction_and_round_trips() -> None:
    values = {"request_id": "r", "start_index": 3, "token_ids": [5, 6], "finish_reason": "stop"}
    built = TrustedBuilder(RequestDelta)(**values)
    assert built == RequestDelta(**values)  # type: ignore[arg-type]
    assert built.model_dump() == RequestDelta(**values).model_dump()  # type: ignore[arg-type]
    new = TrustedBuilder(NewRequestData)(
        request_id="n",
        token_ids=[1, 2, 3],
        num_prompt_tokens=3,
        block_ids=[[4]],
        num_computed_tokens=0,
        sampling=SamplingParams(),
    )
    cached = TrustedBuilder(CachedRequestData)(
        request_id="c", new_block_ids=[[]], num_computed_tokens=9
    )
    plan = TrustedBuilder(StepPlan)(
        step_id=1,
        scheduler_id="s",
        new_requests=[new],
        cached_requests=[cached],
        num_scheduled_tokens={"n": 3, "c": 1},
    )
    assert decode(encode(plan), StepPlan) == plan
    assert plan.finished_request_ids == [] and plan.grammar_bitmask == b""


def test_default_factories_are_called_per_instance() -> None:
    build = TrustedBuilder(RequestDelta)
    a = build(request_id="a", start_index=0)
    b = build(request_id="b", start_index=0)
    a.token_ids.append(1)
    assert b.token_ids == []


def test_missing_required_field_is_an_error() -> None:
    with pytest.raises(TypeError, match="start_index"):
        TrustedBuilder(RequestDelta)(request_id="a")


def test_sampled_tokens_as_the_worker_builds_them() -> None:
    values = {"request_id": "r", "token_ids": [5, 6], "draft_token_ids": [7]}
    built = TrustedBuilder(SampledTokens)(**values)
    assert built == SampledTokens(**values)
    assert decode(encode(StepResult(step_id=0, worker_id="w", sampled=[built]))).sampled == [built]
