"""The persistent batch applies StepPlan diffs: rows, tokens, blocks, computed counts."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker.runner.input_batch import InputBatch, PlanError
from shared.protocol import CachedRequestData, NewRequestData, SamplingParams, StepPlan
from tests.support.plans import new_request


def cached(request_id: str, blocks: list[list[int]], computed: int) -> CachedRequestData:
    return CachedRequestData(
        request_id=request_id, new_block_ids=blocks, num_computed_tokens=computed
    )


def plan(**fields: object) -> StepPlan:
    return StepPlan(step_id=0, scheduler_id="s", **fields)  # type: ignore[arg-type]


def test_add_update_remove_and_row_reuse() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=4, num_cache_blocks=32)
    changes = batch.apply(
        plan(new_requests=[new_request("a", [1, 2, 3], [5]), new_request("b", [4] * 6, [7, 8])])
    )
    assert [row for row, _ in changes.added] == [0, 1]
    assert batch.tokens_of("b") == [4] * 6
    assert batch.block_tables[0, 1, :2].tolist() == [7, 8]

    batch.apply(plan(cached_requests=[cached("a", [[9]], 3)]))
    assert batch.num_blocks[0, 0] == 2
    assert batch.block_tables[0, 0, :2].tolist() == [5, 9]
    assert batch.num_computed_tokens[0] == 3

    changes = batch.apply(plan(finished_request_ids=["a", "unknown"]))
    assert changes.removed_rows == [0]
    assert "a" not in batch and len(batch) == 1
    changes = batch.apply(plan(new_requests=[new_request("c", [6], [1])]))
    assert changes.added[0][0] == 0  # the freed row is reused
    assert batch.num_blocks[0, 0] == 1 and batch.block_tables[0, 0, 0] == 1


def test_preempted_request_comes_back_as_new_with_its_outputs() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4)
    batch.apply(plan(new_requests=[new_request("a", [1, 2, 3], [0])]))
    batch.append_sampled(np.array([0]), np.array([42]))
    assert batch.tokens_of("a") == [1, 2, 3, 42]
    resumed = NewRequestData(
        request_id="a",
        token_ids=[1, 2, 3, 42],
        num_prompt_tokens=3,
        block_ids=[[3, 4]],
        num_computed_tokens=0,
        sampling=SamplingParams(),
    )
    changes = batch.apply(plan(preempted_request_ids=["a"], new_requests=[resumed]))
    assert changes.removed_rows == [0]
    assert batch.tokens_of("a") == [1, 2, 3, 42]
    assert batch.num_prompt_tokens[batch.row_of("a")] == 3
    assert batch.block_tables[0, batch.row_of("a"), :2].tolist() == [3, 4]


def test_new_request_already_present_replaces_it() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4)
    batch.apply(plan(new_requests=[new_request("a", [1, 2], [0])]))
    changes = batch.apply(plan(new_requests=[new_request("a", [7, 8, 9], [2])]))
    assert changes.removed_rows == [0] and len(batch) == 1
    assert batch.tokens_of("a") == [7, 8, 9]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (new_request("x", [1] * 20, [0, 1, 2, 3, 4]), "max_model_len"),
        (new_request("x", [1, 2], [0], computed=3), "num_computed_tokens"),
        (new_request("x", [1, 2], [99]), "outside"),
        (new_request("x", [1, 2], [0, 1, 2, 3, 4]), "blocks exceed"),
    ],
)
def test_invalid_new_requests_are_plan_errors(bad: NewRequestData, message: str) -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4, num_cache_blocks=10)
    with pytest.raises(PlanError, match=message):
        batch.apply(plan(new_requests=[bad]))
    assert len(batch) == 0  # nothing half-added


def test_unknown_cached_request_and_wrong_group_count() -> None:
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4)
    with pytest.raises(PlanError, match="not in the worker's batch"):
        batch.apply(plan(cached_requests=[cached("z", [[]], 0)]))
    batch.apply(plan(new_requests=[new_request("a", [1], [0])]))
    with pytest.raises(PlanError, match="KV cache group"):
        batch.apply(plan(cached_requests=[cached("a", [[], []], 0)]))


def test_batch_full_and_max_model_len_on_append() -> None:
    batch = InputBatch(max_num_reqs=1, max_model_len=4, block_size=4)
    batch.apply(plan(new_requests=[new_request("a", [1, 2, 3], [0])]))
    with pytest.raises(PlanError, match="batch full"):
        batch.apply(plan(new_requests=[new_request("b", [1], [1])]))
    batch.append_sampled(np.array([0]), np.array([5]))
    batch.append_sampled(np.array([0]), np.array([6]))  # full: returned, not stored
    assert batch.tokens_of("a") == [1, 2, 3, 5]
