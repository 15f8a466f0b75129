"""The runner's verification step on a tiny random Llama, plan by plan: accepted drafts, the
correction after a rejection, rollback of num_computed_tokens, and the next step overwriting
the rejected draft's KV, all equal to transformers' greedy continuation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.worker.runner.input_batch import PlanError
from services.worker.runner.model_runner import ModelRunner
from shared.protocol import CachedRequestData, NewRequestData, SamplingParams, StepPlan
from tests.support.tiny_llama import make_tiny_llama, reference_greedy, tiny_runner

PROMPT = [5, 17, 99, 3, 250, 41]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    path = tmp_path_factory.mktemp("tiny_verify")
    hf = make_tiny_llama(path, seed=7)
    return path, reference_greedy(hf, PROMPT, 8)


def new_plan(runner: ModelRunner) -> StepPlan:
    new = NewRequestData(
        request_id="a",
        token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        block_ids=[[1, 2, 3, 4]],
        num_computed_tokens=0,
        sampling=GREEDY,
    )
    return StepPlan(
        step_id=0, scheduler_id="s", new_requests=[new], num_scheduled_tokens={"a": len(PROMPT)}
    )


def verify_plan(step: int, computed: int, drafts: list[int], **extra: object) -> StepPlan:
    cached = CachedRequestData(request_id="a", new_block_ids=[[]], num_computed_tokens=computed)
    return StepPlan(
        step_id=step,
        scheduler_id="s",
        cached_requests=[cached],
        num_scheduled_tokens={"a": 1 + len(drafts)},
        spec_token_ids={"a": drafts},
        **extra,  # type: ignore[arg-type]
    )


def test_accept_reject_and_rollback_follow_the_greedy_reference(tiny) -> None:
    path, ref = tiny
    runner = tiny_runner(path)
    assert runner.execute(new_plan(runner)).sampled[0].token_ids == ref[:1]

    wrong = (ref[3] + 1) % 512
    out = runner.execute(verify_plan(1, len(PROMPT), [ref[1], ref[2], wrong]))
    assert out.sampled[0].token_ids == ref[1:4]  # two accepted, then the correction
    row = runner.batch.req_rows["a"]
    assert runner.batch.num_tokens[row] == len(PROMPT) + 4
    assert runner.batch.num_computed_tokens[row] == len(PROMPT) + 3  # the rejected slot rolled back

    # The next step rewrites the rejected draft's slot (position 9) with the correction's KV.
    out = runner.execute(verify_plan(2, len(PROMPT) + 3, [ref[4], ref[5]]))
    assert out.sampled[0].token_ids == ref[4:7]  # both accepted, then the bonus
    assert runner.batch.tokens_of("a") == PROMPT + ref[:7]


def test_drafts_past_max_model_len_and_short_bitmasks_are_plan_errors(tiny) -> None:
    path, ref = tiny
    runner = tiny_runner(path)
    runner.execute(new_plan(runner))
    too_many = [ref[1]] * (runner.max_model_len - len(PROMPT) - 1)
    with pytest.raises(PlanError, match="max_model_len"):
        runner.prepare_inputs(verify_plan(1, len(PROMPT), too_many))

    runner = tiny_runner(path)
    runner.execute(new_plan(runner))
    words = -(-512 // 32)
    one_row = np.full(words, -1, dtype="<i4").tobytes()  # 3 rows needed: 2 drafts + bonus
    plan = verify_plan(
        1, len(PROMPT), [ref[1], ref[2]], grammar_request_ids=["a"], grammar_bitmask=one_row
    )
    with pytest.raises(PlanError, match="3 rows"):
        runner.execute(plan)
