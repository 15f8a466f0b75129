"""Routed experts from the worker's per-step rows to reply deltas in the gateway's layout: the
first delta carries the prompt rows from `routed_experts_prompt_start`, then one row per token
(token i's row is the forward of position prompt_len - 1 + i), whatever the chunking, whether
the worker sends chunk rows at once or holds them, and across a worker restart."""

from __future__ import annotations

import pytest

from services.gateway.stream.reply_dedup import ReplyCursor
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.protocol import RequestDelta, SamplingParams, SubmitRequest
from tests.unit.scheduler.group_worker import MOE_LAYERS, TOP_K, GroupWorker, row_at
from tests.unit.scheduler.offload.harness import OffloadRig
from tests.unit.scheduler.offload.test_connector import PROMPT as OFFLOADED
from tests.unit.scheduler.offload.test_connector import warm_tier
from tests.unit.scheduler.worker_double import token_at

BS = 4
PROMPT = list(range(40, 50))  # 10 tokens: 3 chunks at 4 tokens per step


def routed(rid: str, start: int, prompt: list[int] = PROMPT, max_tokens: int = 5) -> SubmitRequest:
    return SubmitRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_stream="replies",
        return_routed_experts=True,
        routed_experts_prompt_start=start,
    )


def scheduler(budget: int = 4) -> Scheduler:
    config = SchedulerConfig(
        block_size=BS, num_gpu_blocks=64, max_num_batched_tokens=budget, max_model_len=128
    )
    return Scheduler(config, "s0")


def drive(core: Scheduler, worker: GroupWorker, steps: int = 1000) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    for _ in range(steps):
        plan = core.schedule()
        if plan is None:
            break
        for batch in core.update_from_output(plan, worker.run(plan)).deltas.values():
            deltas += batch
    return deltas


def delivered(deltas: list[RequestDelta], rid: str) -> tuple[list[int], list[int]]:
    """Tokens and flat rows as the gateway keeps them (its de-dup cursor checks the layout)."""
    cursor = ReplyCursor(rid)
    tokens: list[int] = []
    rows: list[int] = []
    for delta in deltas:
        if delta.request_id != rid or (fresh := cursor.fresh(delta)) is None:
            continue
        tokens += fresh.token_ids
        if fresh.token_ids or fresh.routed_experts:
            assert fresh.routed_experts is not None, f"delta at {fresh.start_index} has no rows"
            assert fresh.routed_experts_shape is not None
            assert fresh.routed_experts_shape[1:] == [MOE_LAYERS, TOP_K]
            rows += fresh.routed_experts
    return tokens, rows


def expected_rows(start: int, prompt_len: int, num_tokens: int) -> list[int]:
    positions = [*range(start, prompt_len), *(prompt_len - 1 + i for i in range(num_tokens))]
    return [v for p in positions for v in row_at(p)]


@pytest.mark.parametrize("hold_rows", [False, True])
@pytest.mark.parametrize("start", [0, 3, 9, 10])
def test_rows_follow_the_reply_layout_over_chunked_prefill(hold_rows: bool, start: int) -> None:
    core = scheduler()
    assert core.add_request(routed("r", start)) is None
    deltas = drive(core, GroupWorker(BS, [None], hold_rows=hold_rows))
    tokens, rows = delivered(deltas, "r")
    assert tokens == [token_at("r", 10 + i) for i in range(5)]
    assert rows == expected_rows(start, 10, 5)
    first = deltas[0]
    assert first.start_index == 0 and first.routed_experts_shape is not None
    assert first.routed_experts_shape[0] == 10 - start + len(first.token_ids)


def test_a_worker_restart_mid_decode_recomputes_without_repeating_prompt_rows() -> None:
    core = scheduler(budget=64)
    core.add_request(routed("r", 2, max_tokens=8))
    worker = GroupWorker(BS, [None])
    deltas = drive(core, worker, steps=4)
    assert sum(len(d.token_ids) for d in deltas) == 4
    core.reset_worker_state("w1")  # the worker lost everything: prompt + 4 outputs recompute
    after = drive(core, GroupWorker(BS, [None]))
    assert all(d.start_index > 0 for d in after)
    tokens, rows = delivered(deltas + after, "r")
    assert tokens == [token_at("r", 10 + i) for i in range(8)]
    assert rows == expected_rows(2, 10, 8)


def test_routed_request_is_never_served_from_the_prefix_cache() -> None:
    core = scheduler(budget=64)
    worker = GroupWorker(BS, [None])
    plain = SubmitRequest(
        request_id="a",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=1),
        reply_stream="replies",
    )
    core.add_request(plain)
    drive(core, worker)
    core.add_request(plain.model_copy(update={"request_id": "b"}))
    core.add_request(routed("r", 0, max_tokens=1))
    plan = core.schedule()
    assert plan is not None
    hits = {n.request_id: n.num_computed_tokens for n in plan.new_requests}
    assert hits == {"b": 8, "r": 0}
    out = core.update_from_output(plan, worker.run(plan))
    (r_delta,) = [d for batch in out.deltas.values() for d in batch if d.request_id == "r"]
    assert r_delta.routed_experts == expected_rows(0, 10, 1)


@pytest.mark.parametrize(("start", "accepted"), [(-1, False), (0, True), (10, True), (11, False)])
def test_prompt_start_boundary_is_closed_and_never_clamped(start: int, accepted: bool) -> None:
    core = scheduler()
    msg = routed("r", 0).model_copy(update={"routed_experts_prompt_start": start})
    refused = core.add_request(msg)
    if accepted:
        assert refused is None
    else:
        assert refused is not None and refused.finish_reason == "error"
        assert refused.error is not None and "[0, 10]" in refused.error
        assert not core.has_work()


async def test_routed_request_never_loads_from_the_offload_tier() -> None:
    """An offloaded prefix is KV nobody computed here: loading it would leave prompt rows
    without a forward, so the request computes its whole prompt instead."""
    tier = await warm_tier()
    for return_routed_experts in (False, True):
        rig = OffloadRig.build(tier)
        msg = routed("r", 0, prompt=OFFLOADED)
        rig.scheduler.add_request(
            msg.model_copy(update={"return_routed_experts": return_routed_experts})
        )
        await rig.probe()
        plan = rig.scheduler.schedule()
        assert plan is not None
        if return_routed_experts:
            assert not plan.kv_loads
            assert plan.num_scheduled_tokens == {"r": len(OFFLOADED)}
        else:  # the same prompt without routed experts loads its offloaded prefix
            assert [load.request_id for load in plan.kv_loads] == ["r"]
