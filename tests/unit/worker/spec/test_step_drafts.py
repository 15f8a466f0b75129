"""The drafts a step verifies (services/worker/spec/drafts.py `step_drafts`): the plan's, and
in a plan's lookahead slots the worker's own proposal for the row's current tokens, cut to the
slots; a stale proposal counts for nothing, and slots that disagree with the scheduled tokens
are a PlanError."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.runner.input_batch import InputBatch, PlanError
from services.worker.spec.drafts import step_drafts
from services.worker.spec.proposals import Proposal, ProposalBook
from shared.protocol import NewRequestData, SamplingParams, StepPlan


def batch_with(*prompts: list[int], outputs: int = 0, max_tokens: int = 16) -> InputBatch:
    """One row per prompt, each with `outputs` tokens sampled after it."""
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=4)
    for i, prompt in enumerate(prompts):
        tokens = prompt + [7] * outputs
        batch.add(
            NewRequestData(
                request_id=f"r{i}",
                token_ids=tokens,
                num_prompt_tokens=len(prompt),
                block_ids=[[1 + 16 * i + b for b in range(16)]],
                num_computed_tokens=len(tokens) - 1,
                sampling=SamplingParams(max_tokens=max_tokens),
            )
        )
    return batch


def plan(counts: dict[str, int], **fields: object) -> StepPlan:
    return StepPlan(step_id=1, scheduler_id="s", num_scheduled_tokens=counts, **fields)


def test_own_drafts_fill_the_slots_and_the_counts_shrink_to_them() -> None:
    batch = batch_with([1, 2, 3], [4, 5], [6, 7, 8, 9])
    book = ProposalBook(4)
    book.put(0, Proposal("r0", 3, [11, 12, 13, 14]))  # more than the 3 slots: cut
    book.put(1, Proposal("r1", 1, [21]))  # proposed at 1 token, the row holds 2: stale
    ids = ["r0", "r1", "r2"]
    rows = np.array([0, 1, 2])
    counts = np.array([4, 3, 2])
    step = plan(
        dict(zip(ids, counts.tolist(), strict=True)),
        spec_lookahead={"r0": 3, "r1": 2},
        spec_token_ids={"r2": [31]},
    )
    drafts = step_drafts(step, book, batch, ids, rows, counts)
    assert drafts == {"r0": [11, 12, 13], "r2": [31]}
    assert counts.tolist() == [4, 1, 2]


def test_own_drafts_stop_at_max_tokens_and_a_request_there_is_skipped() -> None:
    """The scheduler plans slots before it knows how many earlier drafts were accepted: the
    worker cuts the drafts so the bonus token is the last of max_tokens, and computes nothing
    for a request that already has them all (its KV was allocated only that far)."""
    book = ProposalBook(4)
    batch = batch_with([1, 2, 3], outputs=3, max_tokens=5)  # 2 tokens left: 1 draft + bonus
    book.put(0, Proposal("r0", 6, [11, 12, 13]))
    counts = np.array([4])
    step = plan({"r0": 4}, spec_lookahead={"r0": 3})
    assert step_drafts(step, book, batch, ["r0"], np.array([0]), counts) == {"r0": [11]}
    assert counts.tolist() == [2]

    done = batch_with([1, 2, 3], outputs=5, max_tokens=5)
    counts = np.array([4])
    assert step_drafts(step, book, done, ["r0"], np.array([0]), counts) == {}
    assert counts.tolist() == [0]


@pytest.mark.parametrize(
    ("counts", "fields"),
    [
        ({"r0": 2}, {"spec_lookahead": {"r0": 3}}),  # 1 + 3 tokens expected
        ({"r0": 4}, {"spec_lookahead": {"r0": 3}, "spec_token_ids": {"r0": [5, 6, 7]}}),
        ({"r0": 0}, {"spec_lookahead": {"r0": -1}}),
    ],
    ids=["count", "both", "negative"],
)
def test_slots_that_disagree_with_the_plan_are_a_plan_error(counts, fields) -> None:
    batch = batch_with([1, 2, 3])
    with pytest.raises(PlanError, match=r"r0: .* lookahead slots"):
        step_drafts(
            plan(counts, **fields),
            ProposalBook(4),
            batch,
            ["r0"],
            np.array([0]),
            np.array(list(counts.values())),
        )
