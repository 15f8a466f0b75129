"""Chunked prefill: long prompts are split across steps within the token budget, and running
decodes are scheduled every step meanwhile."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble, token_at

BUDGET = 32


def make() -> Driver:
    config = SchedulerConfig(
        block_size=16, num_gpu_blocks=64, max_num_batched_tokens=BUDGET, max_model_len=1024
    )
    return Driver(Scheduler(config, "s0"), WorkerDouble(block_size=16))


def test_long_prompt_is_split_and_decodes_keep_running() -> None:
    d = make()
    d.scheduler.add_request(submit("d1", [11, 12, 13], max_tokens=40))
    d.scheduler.add_request(submit("d2", [21, 22], max_tokens=40))
    d.step()  # both prefilled in one step
    d.scheduler.add_request(submit("long", list(range(100, 200)), max_tokens=3))
    chunks: list[int] = []
    while "long" not in d.client.outputs:
        plan = d.step()
        assert plan is not None
        # Every running decode got its one token, every step, before the prefill chunk.
        assert plan.num_scheduled_tokens["d1"] == plan.num_scheduled_tokens["d2"] == 1
        assert list(plan.num_scheduled_tokens)[:2] == ["d1", "d2"]
        assert sum(plan.num_scheduled_tokens.values()) <= BUDGET
        chunks.append(plan.num_scheduled_tokens["long"])
    assert sum(chunks) == 100 and len(chunks) == 4
    assert all(c == BUDGET - 2 for c in chunks[:-1])
    # Partial chunks produced no tokens: the first output came with the last chunk.
    assert d.client.outputs["long"] == [token_at("long", 100)]
    d.run()
    assert d.client.outputs["long"] == [token_at("long", p) for p in range(100, 103)]


def test_chunk_plans_are_diffs_of_one_new_request() -> None:
    d = make()
    d.scheduler.add_request(submit("long", list(range(100, 180)), max_tokens=2))
    first = d.step()
    assert first is not None and first.new_requests[0].num_computed_tokens == 0
    assert len(first.new_requests[0].block_ids[0]) == 2  # slots for 32 tokens only
    second = d.step()
    assert second is not None and not second.new_requests
    (cached,) = second.cached_requests
    assert cached.num_computed_tokens == BUDGET and len(cached.new_block_ids[0]) == 2


def test_several_new_prompts_share_one_budget_fcfs() -> None:
    d = make()
    for i in range(4):
        d.scheduler.add_request(submit(f"p{i}", list(range(1000 + i, 1020 + i)), max_tokens=1))
    plan = d.step()
    assert plan is not None
    assert plan.num_scheduled_tokens == {"p0": 20, "p1": 12}
    plan = d.step()
    assert plan is not None
    assert plan.num_scheduled_tokens == {"p1": 8, "p2": 20, "p3": 4}
    d.run()
    assert set(d.client.finish) == {"p0", "p1", "p2", "p3"}


def test_long_prefill_threshold_leaves_room_for_a_short_prompt_behind_it() -> None:
    """vLLM's long_prefill_token_threshold: a long prompt gets at most THRESHOLD tokens a
    step, so a short prompt queued behind it is prefilled (and samples its first token) in the
    long prompt's first step instead of after all of it; outputs are unchanged."""
    threshold = 12
    config = SchedulerConfig(
        block_size=16,
        num_gpu_blocks=64,
        max_num_batched_tokens=BUDGET,
        long_prefill_token_threshold=threshold,
        max_model_len=1024,
    )
    d = Driver(Scheduler(config, "s0"), WorkerDouble(block_size=16))
    d.scheduler.add_request(submit("long", list(range(100, 150)), max_tokens=2))
    d.scheduler.add_request(submit("short", list(range(300, 310)), max_tokens=2))
    plan = d.step()
    assert plan is not None
    assert plan.num_scheduled_tokens == {"long": threshold, "short": 10}
    assert d.client.outputs["short"] == [token_at("short", 10)]  # its first token, at once
    assert "long" not in d.client.outputs
    chunks = [threshold]
    while "long" not in d.client.outputs:
        plan = d.step()
        assert plan is not None
        chunks.append(plan.num_scheduled_tokens["long"])
    assert chunks == [12, 12, 12, 12, 2]
    d.run()
    assert d.client.outputs["long"] == [token_at("long", p) for p in range(50, 52)]
    assert d.client.outputs["short"] == [token_at("short", p) for p in range(10, 12)]


def test_without_the_threshold_the_long_prompt_takes_the_budget_first() -> None:
    d = make()
    d.scheduler.add_request(submit("long", list(range(100, 150)), max_tokens=2))
    d.scheduler.add_request(submit("short", list(range(300, 310)), max_tokens=2))
    plan = d.step()
    assert plan is not None and plan.num_scheduled_tokens == {"long": BUDGET}
