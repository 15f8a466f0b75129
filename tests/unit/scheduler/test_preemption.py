"""Preemption by recompute when the pool runs dry.

Driven by WorkerDouble, which "samples" a pure function of (request id, position): it is the
scheduler's collaborator, not a model, and it makes every request's full output known in
advance, so preempted-and-resumed requests can be checked token by token.
"""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble, token_at


def make(num_gpu_blocks: int) -> Driver:
    config = SchedulerConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, max_model_len=256)
    return Driver(Scheduler(config, "s0"), WorkerDouble(block_size=4))


def test_last_admitted_is_preempted_and_resumes_with_its_outputs() -> None:
    d = make(num_gpu_blocks=9)  # 8 usable blocks of 4 tokens
    prompts = {"a": [11, 12, 13], "b": [21, 22, 23], "c": [31, 32, 33]}
    for rid, prompt in prompts.items():
        d.scheduler.add_request(submit(rid, prompt, max_tokens=8))
    # Each needs 1 block now, 3 at its peak (3 + 8 - 1 = 10 slots): 9 > 8, someone must yield.
    while not d.plans or not d.plans[-1].preempted_request_ids:
        assert d.step() is not None
    plan = d.plans[-1]
    assert plan.preempted_request_ids == ["c"]  # the last admitted
    assert "c" not in plan.num_scheduled_tokens and not plan.new_requests
    c = d.scheduler.get_request("c")
    assert c is not None and c.status is RequestStatus.PREEMPTED
    assert d.scheduler.waiting[0] is c
    generated = list(c.output_token_ids)
    assert generated  # it had produced tokens before yielding
    resumed = None
    while resumed is None:
        plan = d.step()
        assert plan is not None
        resumed = next((n for n in plan.new_requests if n.request_id == "c"), None)
    assert resumed.token_ids == [*prompts["c"], *generated]
    assert resumed.num_prompt_tokens == 3
    d.run()
    for rid, prompt in prompts.items():
        n = len(prompt)
        assert d.client.outputs[rid] == [token_at(rid, p) for p in range(n, n + 8)]
        assert d.client.finish[rid] == "length"
    assert d.scheduler.num_preemptions >= 1
    assert d.scheduler.kv.num_free_blocks == 8


def test_the_last_request_preempting_itself_ends_the_running_pass() -> None:
    d = make(num_gpu_blocks=4)  # 3 usable blocks of 4 tokens
    d.scheduler.add_request(submit("a", [1, 2], max_tokens=4))  # peak 5 slots: 2 blocks
    d.scheduler.add_request(submit("b", list(range(10, 18)), max_tokens=2))  # 8 + 1 slots
    d.step()  # a: 1 block, b: 2 blocks; pool full
    plan = d.step()  # a fits in its block; b needs a 3rd and is itself the last: it yields
    assert plan is not None
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.preempted_request_ids == ["b"]
    assert d.scheduler.running == [d.scheduler.get_request("a")]
    d.run()
    assert d.client.finish == {"a": "length", "b": "length"}
    assert d.client.outputs["b"] == [token_at("b", 8), token_at("b", 9)]
    resumed = [n for p in d.plans for n in p.new_requests if n.request_id == "b"][-1]
    assert resumed.token_ids == [*range(10, 18), token_at("b", 8)]


def test_many_requests_under_pressure_all_finish_exactly() -> None:
    d = make(num_gpu_blocks=13)
    for i in range(12):
        prompt = [100 + i, 200 + i, 300 + i, 400 + i, 500 + i][: 1 + i % 5]
        d.scheduler.add_request(submit(f"r{i:02d}", prompt, max_tokens=10 + i))
    d.run()
    assert d.scheduler.num_preemptions > 0
    for i in range(12):
        rid, n = f"r{i:02d}", 1 + i % 5
        assert d.client.outputs[rid] == [token_at(rid, p) for p in range(n, n + 10 + i)]
    assert d.scheduler.kv.num_free_blocks == 12
