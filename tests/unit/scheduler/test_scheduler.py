"""Scheduler lifecycle: abort, worker restart, failed steps, rejections, plan/delta shapes."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.codec import decode, encode
from shared.config import SchedulerSettings
from shared.protocol import SampledTokens, StepPlan, StepResult, TokenDelta, WorkerReady
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble, token_at


def make(**overrides: object) -> Driver:
    fields: dict[str, object] = {"block_size": 4, "num_gpu_blocks": 33, "max_model_len": 128}
    fields.update(overrides)
    config = SchedulerConfig(**fields)  # type: ignore[arg-type]
    return Driver(Scheduler(config, "s0"), WorkerDouble(block_size=4))


def test_abort_of_a_running_request_frees_blocks_now_and_tells_the_worker_next_plan() -> None:
    d = make()
    d.scheduler.add_request(submit("a", [1, 2, 3, 4, 5, 6], max_tokens=50))
    d.scheduler.add_request(submit("b", [7, 8], max_tokens=50))
    for _ in range(3):
        d.step()
    free_with_a = d.scheduler.kv.num_free_blocks
    a = d.scheduler.get_request("a")
    assert a is not None
    held = len(d.scheduler.kv.get_block_ids("a")[0])
    delta = d.scheduler.abort_request("a")
    assert delta is not None and delta.finish_reason == "abort"
    assert delta.start_index == 3 and not delta.token_ids
    assert d.scheduler.kv.num_free_blocks == free_with_a + held
    assert d.scheduler.abort_request("a") is None  # unknown now
    plan = d.step()
    assert plan is not None and plan.finished_request_ids == ["a"]
    assert "a" not in plan.num_scheduled_tokens
    next_plan = d.step()
    assert next_plan is not None and next_plan.finished_request_ids == []


def test_abort_while_its_step_runs_drops_the_step_tokens() -> None:
    d = make()
    d.scheduler.add_request(submit("a", [1, 2, 3], max_tokens=50))
    d.step()
    plan = d.scheduler.schedule()
    assert plan is not None
    d.scheduler.abort_request("a")
    out = d.scheduler.update_from_output(plan, d.worker.run(plan))
    assert out.deltas == {} and out.finished_request_ids == []
    assert d.scheduler.kv.num_free_blocks == 32
    assert not d.scheduler.has_work()


def test_abort_of_a_waiting_request_is_not_sent_to_the_worker() -> None:
    d = make(max_num_seqs=1)
    d.scheduler.add_request(submit("a", [1, 2], max_tokens=5))
    d.scheduler.add_request(submit("b", [3, 4], max_tokens=5))
    d.step()
    delta = d.scheduler.abort_request("b")
    assert delta is not None and delta.start_index == 0
    d.run()
    assert all("b" not in p.finished_request_ids for p in d.plans)
    assert d.client.finish == {"a": "length"}


def test_reset_worker_state_resends_every_running_request_with_its_outputs() -> None:
    d = make()
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7, 8, 9, 10, 11, 12, 13, 14]}
    for rid, prompt in prompts.items():
        d.scheduler.add_request(submit(rid, prompt, max_tokens=12))
    for _ in range(5):
        d.step()
    d.scheduler.abort_request("b")  # pending removal for the old worker: must not leak
    d.scheduler.add_request(submit("b2", prompts["b"], max_tokens=12))
    d.step()
    outputs = {rid: list(r.output_token_ids) for rid, r in d.scheduler.requests.items()}
    d.scheduler.reset_worker_state("w1")
    d.worker = WorkerDouble(block_size=4, incarnation="w1")  # a fresh worker: empty KV
    assert d.scheduler.kv.num_free_blocks == 32 and not d.scheduler.kv.pool.cached
    plan = d.step()
    assert plan is not None and plan.worker_incarnation == "w1"
    assert not plan.finished_request_ids and not plan.preempted_request_ids
    assert {n.request_id for n in plan.new_requests} == {"a", "b2"}
    for new in plan.new_requests:
        prompt = prompts["a" if new.request_id == "a" else "b"]
        assert new.token_ids == [*prompt, *outputs[new.request_id]]
        assert new.num_computed_tokens == 0  # no KV survived
    d.run()
    assert d.client.outputs["a"] == [token_at("a", p) for p in range(5, 17)]
    assert d.client.outputs["b2"] == [token_at("b2", p) for p in range(9, 21)]


def test_failed_step_recomputes_its_requests_then_errors_after_repeated_failures() -> None:
    d = make(max_step_failures=2)
    d.scheduler.add_request(submit("a", [1, 2, 3], max_tokens=6))
    d.step()
    plan = d.scheduler.schedule()
    assert plan is not None
    failed = StepResult(step_id=plan.step_id, worker_id="w", error="CUDA error")
    out = d.scheduler.update_from_output(plan, failed)
    assert out.deltas == {}
    assert d.scheduler.kv.num_free_blocks == 32 and not d.scheduler.running
    retry = d.scheduler.schedule()
    assert retry is not None and retry.preempted_request_ids == ["a"]
    (new,) = retry.new_requests
    assert new.token_ids == [1, 2, 3, token_at("a", 3)]
    out = d.scheduler.update_from_output(
        retry, StepResult(step_id=retry.step_id, worker_id="w", error="CUDA error")
    )
    (delta,) = out.deltas["replies:a"]
    assert delta.finish_reason == "error" and delta.error == "CUDA error"
    assert delta.start_index == 1
    assert out.finished_request_ids == ["a"]
    assert not d.scheduler.has_work() and d.scheduler.kv.num_free_blocks == 32


def test_a_failed_step_then_success_yields_the_exact_outputs() -> None:
    d = make()
    d.scheduler.add_request(submit("a", [1, 2, 3], max_tokens=6))
    d.step()
    d.step()
    plan = d.scheduler.schedule()
    assert plan is not None
    d.scheduler.update_from_output(
        plan, StepResult(step_id=plan.step_id, worker_id="w", error="boom")
    )
    d.run()
    assert d.client.outputs["a"] == [token_at("a", p) for p in range(3, 9)]
    assert d.scheduler.snapshot().num_step_failures == 1


def test_missing_sample_for_a_sampled_request_recomputes_it() -> None:
    d = make()
    d.scheduler.add_request(submit("a", [1, 2, 3], max_tokens=3))
    plan = d.scheduler.schedule()
    assert plan is not None
    d.worker.run(plan)
    out = d.scheduler.update_from_output(plan, StepResult(step_id=plan.step_id, worker_id="w"))
    assert out.deltas == {}
    retry = d.scheduler.schedule()
    assert retry is not None and retry.preempted_request_ids == ["a"]
    assert [n.request_id for n in retry.new_requests] == ["a"]


def test_token_ids_outside_the_workers_vocabulary_are_refused_not_planned() -> None:
    d = make(vocab_size=50)
    outside = d.scheduler.add_request(submit("x", [1, 50, 2]))
    assert outside is not None and outside.finish_reason == "error"
    assert "vocabulary [0, 50)" in (outside.error or "")
    stop = d.scheduler.add_request(submit("y", [1, 2], stop_token_ids=[70]))
    assert stop is not None and "stop_token_ids" in (stop.error or "")
    assert d.scheduler.add_request(submit("z", [0, 49], max_tokens=2)) is None
    assert [r.request_id for r in d.scheduler.waiting] == ["z"]


def test_rejections_and_idempotent_resubmission() -> None:
    d = make(max_model_len=16, num_gpu_blocks=4)  # 3 usable blocks of 4 = 12 slots
    too_long = d.scheduler.add_request(submit("x", list(range(16))))  # no room for output
    assert too_long is not None and too_long.finish_reason == "error"
    assert "max_model_len" in (too_long.error or "")
    too_big = d.scheduler.add_request(submit("y", list(range(10)), max_tokens=5))
    assert too_big is not None and too_big.finish_reason == "error"
    assert "KV blocks" in (too_big.error or "")
    assert d.scheduler.add_request(submit("z", list(range(10)), max_tokens=3)) is None
    assert d.scheduler.add_request(submit("z", list(range(10)), max_tokens=3)) is None
    assert len(d.scheduler.waiting) == 1
    d.run()
    assert d.client.finish == {"z": "length"}


def test_deltas_are_grouped_by_reply_stream_and_first_delta_carries_counts() -> None:
    d = make()
    for rid in ("a1", "a2", "b1"):
        d.scheduler.add_request(submit(rid, [1, 2, 3, 4, 5], max_tokens=2))
    plan = d.scheduler.schedule()
    assert plan is not None
    out = d.scheduler.update_from_output(plan, d.worker.run(plan))
    assert sorted(out.deltas) == ["replies:a", "replies:b"]
    assert [x.request_id for x in out.deltas["replies:a"]] == ["a1", "a2"]
    first = out.deltas["replies:b"][0]
    assert first.num_prompt_tokens == 5 and first.start_index == 0
    messages = out.token_deltas("s0")
    assert all(isinstance(m, TokenDelta) and m.scheduler_id == "s0" for _, m in messages)
    plan = d.scheduler.schedule()
    assert plan is not None
    out = d.scheduler.update_from_output(plan, d.worker.run(plan))
    second = out.deltas["replies:b"][0]
    assert second.start_index == 1 and second.num_prompt_tokens == 0
    assert second.finish_reason == "length"
    assert sorted(out.finished_request_ids) == ["a1", "a2", "b1"]


def test_plans_and_deltas_survive_the_wire() -> None:
    """The core builds messages without re-validation; the codec must accept them as is."""
    d = make()
    d.scheduler.add_request(submit("a", list(range(10, 30)), max_tokens=4))
    plan = d.scheduler.schedule()
    assert plan is not None
    assert decode(encode(plan), StepPlan) == plan
    result = StepResult(
        step_id=plan.step_id,
        worker_id="w",
        sampled=[
            SampledTokens(
                request_id="a",
                token_ids=[5, 6],
                logprobs=[-0.5, -1.5],
                top_token_ids=[5, 9, 6, 9],
                top_logprobs=[-0.5, -2.0, -1.5, -2.5],
            )
        ],
    )
    d.worker.run(plan)
    out = d.scheduler.update_from_output(plan, result)
    ((stream, message),) = out.token_deltas("s0")
    assert stream == "replies:a"
    assert decode(encode(message), TokenDelta) == message
    (delta,) = message.deltas
    assert delta.token_ids == [5, 6] and delta.logprobs == [-0.5, -1.5]
    assert delta.top_token_ids == [5, 9, 6, 9]
    plan = d.scheduler.schedule()
    assert plan is not None
    assert decode(encode(plan), StepPlan) == plan


def test_step_ids_increase_and_nothing_to_run_gives_none() -> None:
    d = make()
    assert d.scheduler.schedule() is None
    d.scheduler.add_request(submit("a", [1], max_tokens=3))
    d.run()
    assert [p.step_id for p in d.plans] == [0, 1, 2]
    assert d.scheduler.schedule() is None


def test_config_from_worker_takes_capacity_from_the_worker() -> None:
    ready = WorkerReady(
        worker_id="w",
        incarnation="i",
        model="m",
        num_kv_blocks=500,
        block_size=32,
        vocab_size=100,
        max_model_len=4096,
        eos_token_ids=[2],
    )
    config = SchedulerConfig.from_worker(SchedulerSettings(max_model_len=1024), ready)
    assert (config.num_gpu_blocks, config.block_size, config.max_model_len) == (500, 32, 1024)
    assert config.eos_token_ids == [2]
    assert config.kv_cache_groups[0].spec.block_size == 32
    unlimited = SchedulerConfig.from_worker(SchedulerSettings(max_model_len=0), ready)
    assert unlimited.max_model_len == 4096


def test_waiting_queue_is_fcfs_a_blocked_head_is_not_overtaken() -> None:
    d = make(num_gpu_blocks=5)  # 4 usable blocks of 4
    d.scheduler.add_request(submit("a", [1, 2, 3, 4, 5], max_tokens=3))  # 2 blocks
    d.step()
    d.scheduler.add_request(submit("big", list(range(10, 22)), max_tokens=1))  # 3 blocks
    d.scheduler.add_request(submit("small", [30, 31], max_tokens=1))  # 1 block: would fit
    plan = d.step()
    assert plan is not None and plan.num_scheduled_tokens == {"a": 1}
    d.run()
    first_plan_of = {
        rid: next(i for i, p in enumerate(d.plans) if rid in p.num_scheduled_tokens)
        for rid in ("big", "small")
    }
    assert first_plan_of["big"] <= first_plan_of["small"]
    assert set(d.client.finish) == {"a", "big", "small"}


def test_results_of_steps_not_in_flight_are_ignored() -> None:
    d = make()
    d.scheduler.add_request(submit("a", [1, 2, 3], max_tokens=5))
    d.step()
    stale_plan = d.scheduler.schedule()  # in flight when the worker dies
    assert stale_plan is not None
    stale_result = d.worker.run(stale_plan)
    d.scheduler.reset_worker_state("w1")
    d.worker = WorkerDouble(block_size=4, incarnation="w1")
    fresh = d.scheduler.schedule()  # "a" is running again, resent as new, in flight
    assert fresh is not None and [n.request_id for n in fresh.new_requests] == ["a"]
    assert d.scheduler.update_from_output(stale_plan, stale_result).deltas == {}
    failed = StepResult(step_id=stale_plan.step_id, worker_id="w", error="late")
    assert d.scheduler.update_from_output(stale_plan, failed).deltas == {}
    assert d.scheduler.running and d.scheduler.snapshot().num_step_failures == 0
    out = d.scheduler.update_from_output(fresh, d.worker.run(fresh))
    for stream, deltas in out.deltas.items():
        for delta in deltas:
            d.client.apply(stream, delta)
    d.plans.append(fresh)
    # A repeated result of a step already applied is ignored too.
    repeat = d.plans[-1]
    again = StepResult(
        step_id=repeat.step_id,
        worker_id="w",
        sampled=[SampledTokens(request_id="a", token_ids=[5])],
    )
    assert d.scheduler.update_from_output(repeat, again).deltas == {}
    d.run()
    assert d.client.outputs["a"] == [token_at("a", p) for p in range(3, 8)]
