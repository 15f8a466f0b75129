"""Runs a Scheduler against a WorkerDouble step by step and collects what clients would see."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.scheduler import Scheduler
from shared.protocol import FinishReason, RequestDelta, SamplingParams, StepPlan, SubmitRequest
from tests.unit.scheduler.worker_double import WorkerDouble


def submit(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 8,
    cache_salt: str | None = None,
    priority: int = 0,
    arrival_time: float = 0.0,
    **sampling: object,
) -> SubmitRequest:
    return SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        reply_stream=f"replies:{request_id[:1]}",
        cache_salt=cache_salt,
        priority=priority,
        arrival_time=arrival_time,
    )


@dataclass
class ClientView:
    """Per request: the output tokens as a client assembles them from deltas."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    stop_token: dict[str, int | None] = field(default_factory=dict)
    first: dict[str, RequestDelta] = field(default_factory=dict)

    def apply(self, stream: str, delta: RequestDelta) -> None:
        rid = delta.request_id
        assert stream == f"replies:{rid[:1]}"
        assert rid not in self.finish, f"delta for {rid} after it finished"
        out = self.outputs.setdefault(rid, [])
        assert delta.start_index == len(out), f"{rid}: gap or repeat at {delta.start_index}"
        self.first.setdefault(rid, delta)
        out.extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish[rid] = delta.finish_reason
            self.stop_token[rid] = delta.stop_token_id


@dataclass
class Driver:
    scheduler: Scheduler
    worker: WorkerDouble
    client: ClientView = field(default_factory=ClientView)
    plans: list[StepPlan] = field(default_factory=list)

    def step(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        total = sum(plan.num_scheduled_tokens.values())
        assert 0 < total <= self.scheduler.config.max_num_batched_tokens
        self.plans.append(plan)
        out = self.scheduler.update_from_output(plan, self.worker.run(plan))
        for stream, deltas in out.deltas.items():
            for delta in deltas:
                self.client.apply(stream, delta)
        return plan

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.step() is None:
                assert not self.scheduler.has_work(), "work left but nothing schedulable"
                return
        raise AssertionError(f"not done after {max_steps} steps")
