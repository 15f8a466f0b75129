"""Priority scheduling (MESHLLM_SCHEDULING_POLICY=priority, vLLM v1's): the waiting queue in
(priority, arrival) order on every insert, the least urgent running request preempted when a
block is missing, no preemption to admit anyone; under fcfs (the default) a request priority
other than 0 is refused.

Driven by WorkerDouble (worker_double.py), so every request's output is known in advance and
checked token by token whatever preemptions happen on the way, and its prefix-content check
catches a prefix hit on a block whose KV was never written.
"""

from __future__ import annotations

from collections import deque

import pytest
from pydantic import ValidationError

from services.scheduler.config import SchedulerConfig, SchedulingPolicy
from services.scheduler.pd.prefill_job import PrefillPolicy
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.waiting_queue import PriorityWaitingQueue, waiting_queue
from shared.config import SchedulerSettings
from shared.protocol import ProgressCheckpoint, SamplingParams, StepResult, WorkerReady
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import WorkerDouble, token_at

BS = 4
FCFS_REFUSAL = (
    "priority scheduling is not enabled (MESHLLM_SCHEDULING_POLICY=fcfs); priority must be 0"
)


def make(
    policy: SchedulingPolicy = "priority", num_gpu_blocks: int = 64, **fields: object
) -> Driver:
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=64,
        scheduling_policy=policy,
        **fields,  # type: ignore[arg-type]
    )
    return Driver(Scheduler(config, "s0"), WorkerDouble(block_size=BS))


def admitted(d: Driver) -> list[str]:
    """Every admission (a re-admission after preemption too), in plan order."""
    return [n.request_id for plan in d.plans for n in plan.new_requests]


def preempted(d: Driver) -> list[str]:
    return [rid for plan in d.plans for rid in plan.preempted_request_ids]


def assert_exact_outputs(d: Driver, prompt_lens: dict[str, int], max_tokens: int) -> None:
    for rid, n in prompt_lens.items():
        assert d.client.outputs[rid] == [token_at(rid, p) for p in range(n, n + max_tokens)]
        assert d.client.finish[rid] == "length"


# ------------------------------------------------------------------------------ admission


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    d = make(max_num_seqs=1)  # one at a time: the admission order is the queue's order
    arrivals = [  # (id, priority, arrival_time), in intake order
        ("late", 0, 5.0),
        ("low", 3, 1.0),  # the earliest arrival, but the least urgent
        ("urgent", -2, 9.0),  # vLLM's priorities may be negative: lower is served earlier
        ("early", 0, 2.0),
        ("c1", 0, 3.0),  # two choices of one call share the arrival time: intake order
        ("c0", 0, 3.0),
    ]
    for rid, priority, arrival in arrivals:
        msg = submit(rid, [11, 12, 13], max_tokens=3, priority=priority, arrival_time=arrival)
        assert d.scheduler.add_request(msg) is None
    assert [r.request_id for r in d.scheduler.waiting] == [
        "urgent", "early", "c1", "c0", "late", "low",
    ]  # fmt: skip
    d.run()
    assert admitted(d) == ["urgent", "early", "c1", "c0", "late", "low"]
    assert d.scheduler.num_preemptions == 0
    assert_exact_outputs(d, {rid: 3 for rid, _, _ in arrivals}, 3)


def test_a_more_urgent_arrival_preempts_no_running_request() -> None:
    """vLLM preempts only for a running request's missing block, never to admit: the urgent
    request waits for the running one, and then goes first."""
    d = make(max_num_seqs=1)
    d.scheduler.add_request(submit("slow", [11, 12], max_tokens=6, priority=5, arrival_time=1.0))
    d.step()
    d.scheduler.add_request(submit("other", [21, 22], max_tokens=2, priority=5, arrival_time=2.0))
    d.scheduler.add_request(submit("vip", [31, 32], max_tokens=2, priority=-1, arrival_time=3.0))
    d.run()
    assert admitted(d) == ["slow", "vip", "other"]
    assert preempted(d) == [] and d.scheduler.num_preemptions == 0
    assert_exact_outputs(d, {"slow": 2}, 6)


# ----------------------------------------------------------------------------- preemption


def test_the_victim_is_the_largest_priority_then_arrival_not_the_last_admitted() -> None:
    d = make(num_gpu_blocks=7)  # 6 usable blocks; each request peaks at 3 (3 + 10 - 1 slots)
    d.scheduler.add_request(submit("y", [21, 22, 23], max_tokens=10, priority=1, arrival_time=2.0))
    d.step()
    d.scheduler.add_request(submit("x", [31, 32, 33], max_tokens=10, priority=1, arrival_time=1.0))
    d.step()
    d.scheduler.add_request(submit("z", [41, 42, 43], max_tokens=10, priority=0, arrival_time=3.0))
    while not preempted(d):
        assert d.step() is not None
    assert [r.request_id for r in d.scheduler.running] == ["x", "z"]
    plan = d.plans[-1]
    # Running in admission order [y, x, z]: fcfs would drop z, the last admitted; priority
    # drops y (priority 1 like x, but the later arrival), here the very request that needed
    # the block, and the more urgent ones after it still run in this plan.
    assert plan.preempted_request_ids == ["y"]
    assert plan.num_scheduled_tokens == {"x": 1, "z": 1}
    d.run()
    assert admitted(d) == ["y", "x", "z", "y"]
    assert_exact_outputs(d, {"x": 3, "y": 3, "z": 3}, 10)
    assert d.scheduler.kv.num_free_blocks == 6


def test_a_victim_scheduled_earlier_in_the_pass_is_taken_back_out_of_the_plan() -> None:
    """The least urgent request was admitted first, so it is scheduled before the request that
    then lacks a block: its part of the plan goes (tokens, blocks, the prefix-cache entry of
    the block its chunk was to fill), and its re-admission hits only blocks whose KV was
    written (WorkerDouble fails the run on a hit of a never-written block)."""
    d = make(num_gpu_blocks=7, long_prefill_token_threshold=6)  # 6 usable blocks
    prompt_a = list(range(100, 120))  # 4 chunks of at most 6 tokens; peak 21 slots: 6 blocks
    d.scheduler.add_request(submit("a", prompt_a, max_tokens=2, priority=5, arrival_time=1.0))
    d.step()  # a: tokens 0-5 in blocks A0, A1
    d.scheduler.add_request(submit("b", [11, 12, 13, 14], max_tokens=5, priority=0))
    d.step()  # a: 6-11 (A2); b admitted: 0-3 (B0); 2 blocks left
    a = d.scheduler.get_request("a")
    assert a is not None and a.num_computed_tokens == 12
    assert [r.request_id for r in d.scheduler.running] == ["a", "b"]
    # a's chunk 12-17 takes the last 2 blocks (A3 full, registered; A4 partial), then b's
    # token 4 finds none: a is the victim, after it was scheduled.
    plan = d.step()
    assert plan is not None
    assert plan.preempted_request_ids == ["a"]
    assert plan.num_scheduled_tokens == {"b": 1}
    assert [c.request_id for c in plan.cached_requests] == ["b"]
    assert a.num_computed_tokens == 0 and a.num_output_placeholders == 0
    d.run()
    (resumed,) = [n for p in d.plans[3:] for n in p.new_requests if n.request_id == "a"]
    assert resumed.num_computed_tokens == 12  # A0-A2 hit; A3's registration was taken back
    assert_exact_outputs(d, {"a": 20}, 2)
    assert_exact_outputs(d, {"b": 4}, 5)
    assert d.scheduler.kv.num_free_blocks == 6


def test_a_preempted_request_goes_back_ahead_of_less_urgent_waiting_ones() -> None:
    d = make(num_gpu_blocks=5, max_num_seqs=2)  # 4 usable blocks; each peaks at 3
    arrivals = [
        ("u", 0, 1.0),
        ("h", 1, 2.0),
        ("m", 1, 3.0),  # h's priority, arrived after it
        ("l1", 5, 0.5),  # arrived first, least urgent
        ("l2", 5, 4.0),
    ]
    for rid, priority, arrival in arrivals:
        msg = submit(rid, [11, 12, 13], max_tokens=10, priority=priority, arrival_time=arrival)
        d.scheduler.add_request(msg)
    while not preempted(d):
        assert d.step() is not None
    assert d.plans[-1].preempted_request_ids == ["h"]  # running u and h: h is less urgent
    # h keeps its arrival: back ahead of m (same priority, later) and of l1 (earlier, but
    # less urgent), where fcfs would put it back at the front anyway.
    assert [r.request_id for r in d.scheduler.waiting] == ["h", "m", "l1", "l2"]
    d.run()
    # Each pair of running requests drops its less urgent one when blocks run out, and each
    # victim is re-admitted before anyone less urgent.
    assert preempted(d) == ["h", "m", "l1", "l2"]
    assert admitted(d) == ["u", "h", "h", "m", "m", "l1", "l1", "l2", "l2"]
    assert_exact_outputs(d, {rid: 3 for rid, _, _ in arrivals}, 10)
    assert d.scheduler.kv.num_free_blocks == 4


def test_requeued_requests_keep_their_place_by_priority() -> None:
    """Every way back into the queue is an ordered insert: a failed step and a worker reset
    put the running request between the waiting ones (fcfs: at the front)."""
    d = make(max_num_seqs=1)
    d.scheduler.add_request(submit("r", [11, 12], max_tokens=4, priority=2, arrival_time=1.0))
    d.step()
    d.scheduler.add_request(submit("w", [21, 22], max_tokens=4, priority=1, arrival_time=2.0))
    d.scheduler.add_request(submit("v", [31, 32], max_tokens=4, priority=3, arrival_time=0.5))
    plan = d.scheduler.schedule()
    assert plan is not None and list(plan.num_scheduled_tokens) == ["r"]
    failed = StepResult(step_id=plan.step_id, worker_id="w", error="device lost")
    d.scheduler.update_from_output(plan, failed)
    assert [q.request_id for q in d.scheduler.waiting] == ["w", "r", "v"]
    d.step()  # w admitted
    d.scheduler.reset_worker_state("w1")
    d.worker = WorkerDouble(block_size=BS, incarnation="w1")
    assert [q.request_id for q in d.scheduler.waiting] == ["w", "r", "v"]
    d.run()
    assert_exact_outputs(d, {"r": 2, "w": 2, "v": 2}, 4)


# ------------------------------------------------------------------------------------ fcfs


@pytest.mark.parametrize("priority", [1, -1])
def test_fcfs_refuses_a_priority_other_than_0(priority: int) -> None:
    d = make("fcfs")
    refused = d.scheduler.add_request(submit("p", [11, 12], priority=priority))
    assert refused is not None and refused.finish_reason == "error"
    assert refused.error == FCFS_REFUSAL
    assert refused.error_type == "invalid_request_error"  # the client's fault: a 400
    assert d.scheduler.get_request("p") is None and not d.scheduler.waiting


def test_fcfs_admits_priority_0_in_arrival_order_as_before() -> None:
    d = make("fcfs", max_num_seqs=1)
    assert SchedulerConfig().scheduling_policy == "fcfs"  # the default
    assert isinstance(d.scheduler.waiting, deque)  # exactly today's queue
    for rid in ("b", "a", "c"):  # intake order, whatever the arrival times say
        arrival = {"a": 1.0, "b": 2.0, "c": 3.0}[rid]
        msg = submit(rid, [11, 12], max_tokens=2, arrival_time=arrival)
        assert d.scheduler.add_request(msg) is None
    d.run()
    assert admitted(d) == ["b", "a", "c"]
    assert_exact_outputs(d, {"a": 2, "b": 2, "c": 2}, 2)


# ---------------------------------------------------------------------- the queue itself


def request(rid: str, priority: int, arrival: float, seq: int = 0) -> Request:
    return Request(
        rid, [1], SamplingParams(), "replies", BS,
        arrival_time=arrival, priority=priority, arrival_seq=seq,
    )  # fmt: skip


def test_the_priority_queue_orders_every_insert_whichever_end() -> None:
    q = PriorityWaitingQueue()
    a, b, c, d, e = (
        request("a", 0, 1.0),
        request("b", 0, 2.0),
        request("c", -1, 5.0),
        request("d", 0, 2.0, seq=1),
        request("e", 2, 0.0),
    )
    q.append(b)
    q.appendleft(e)  # the deque's front, but the least urgent
    q.extendleft([d, a])
    q.append(c)
    assert [r.request_id for r in q] == ["c", "a", "b", "d", "e"]
    assert q[0] is c and len(q) == 5
    q.remove(b)
    assert q.popleft() is c and q.popleft() is a
    assert [r.request_id for r in q] == ["d", "e"]


def test_the_fcfs_queue_is_a_deque() -> None:
    q = waiting_queue("fcfs")
    a, b, c = request("a", 0, 1.0), request("b", 0, 2.0), request("c", 0, 3.0)
    q.append(b)
    q.appendleft(c)  # goes back to the front, whatever its arrival
    q.extendleft([a])
    assert [r.request_id for r in q] == ["a", "c", "b"]


# -------------------------------------------------------------- priority travels with it


def test_priority_survives_every_rebuild_of_a_request() -> None:
    msg = submit("a", [3, 4, 5, 6, 7, 8, 9, 10], max_tokens=6, priority=4, arrival_time=7.5)
    assert Request.from_submit(msg, BS).priority == 4
    d = make()
    d.scheduler.add_request(submit("b", [11, 12], priority=5))
    checkpoint = ProgressCheckpoint(
        request_id="a", num_prompt_tokens=8, output_token_ids=[token_at("a", 8)]
    )
    assert d.scheduler.add_request(msg, checkpoint=checkpoint) is None  # taken over
    resumed = d.scheduler.get_request("a")
    assert resumed is not None and resumed.num_output_tokens == 1  # from its checkpoint
    assert (resumed.priority, resumed.arrival_time) == (4, 7.5)
    assert [r.request_id for r in d.scheduler.waiting] == ["a", "b"]
    job = PrefillPolicy(lookahead=0, block_size=BS).job_for(msg)  # P/D: the prefill side's
    assert job is not None and job.priority == 4


# ------------------------------------------------------------------------------- settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A developer's own MESHLLM_* variables must not leak into these tests."""
    import os

    for key in list(os.environ):
        if key.startswith("MESHLLM_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_the_policy_setting_is_read_and_validated(clean_env: pytest.MonkeyPatch) -> None:
    ready = WorkerReady(
        worker_id="w", incarnation="i", model="m", num_kv_blocks=64, block_size=BS,
        vocab_size=1000, max_model_len=64,
    )  # fmt: skip
    assert SchedulerConfig.from_worker(SchedulerSettings(), ready).scheduling_policy == "fcfs"
    clean_env.setenv("MESHLLM_SCHEDULING_POLICY", "priority")
    settings = SchedulerSettings()
    assert settings.scheduling_policy == "priority"
    assert SchedulerConfig.from_worker(settings, ready).scheduling_policy == "priority"


def test_a_bad_policy_is_a_start_up_error(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MESHLLM_SCHEDULING_POLICY", "lifo")
    with pytest.raises(ValidationError, match="scheduling_policy") as info:
        SchedulerSettings()  # what `python -m services.scheduler` builds first
    assert "'fcfs' or 'priority'" in str(info.value)
    with pytest.raises(ValidationError):
        SchedulerConfig(scheduling_policy="lifo")  # type: ignore[arg-type]
