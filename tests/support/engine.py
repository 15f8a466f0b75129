"""The scheduler core and the model runner coupled in one process, without the bus.

This is the mesh's step loop minus Redis: schedule -> execute -> update. Tests use it to check
scheduling and model together (parity with transformers under batching, chunked prefill,
prefix caching and preemption) quickly; the e2e tests check the same through real processes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.worker.loader import load_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import LaunchedStep, ModelRunner
from services.worker.spec import SpeculativeConfig
from shared.protocol import RequestDelta, SamplingParams, StepPlan, StepResult, SubmitRequest


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # when the request asked for them
    top_token_ids: list[int] = field(default_factory=list)  # logprobs > 0: per token, flat
    top_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[float] | None = None  # when the request asked for them
    prompt_top_token_ids: list[int] = field(default_factory=list)
    prompt_top_logprobs: list[float] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)


class InProcessEngine:
    def __init__(
        self,
        model_dir: Path | str,
        *,
        num_blocks: int = 512,
        num_state_blocks: int | None = None,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        dtype: torch.dtype = torch.float32,
        enable_prefix_caching: bool = True,
        model_and_config: tuple | None = None,
        speculative: SpeculativeConfig | None = None,
        scheduler_options: dict[str, object] | None = None,
        runner_options: dict[str, object] | None = None,
        device: str = "cpu",
    ) -> None:
        model, config = model_and_config or load_model(model_dir, dtype, device)
        self.model, self.model_config = model, config
        # A hybrid model's state pool: as many blocks as attention unless told (KVCache).
        self.kv_cache = KVCache.allocate(
            config, num_blocks, block_size, dtype, device, num_state_blocks
        )
        max_model_len = min(config.max_position_embeddings, 4096)
        self.runner = ModelRunner(
            model,
            config,
            self.kv_cache,
            device,
            max_model_len=max_model_len,
            speculative=speculative,
            **(runner_options or {}),  # type: ignore[arg-type]
        )
        spec_tokens = speculative.num_spec_tokens if speculative and speculative.enabled else 0
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=block_size,
                num_gpu_blocks=num_blocks,
                num_state_blocks=self.kv_cache.num_state_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                eos_token_ids=list(config.eos_token_ids),
                num_spec_tokens=spec_tokens,
                **(scheduler_options or {}),  # type: ignore[arg-type]
            ),
            "test-scheduler",
        )
        self.steps = 0
        self.planned_ahead = 0  # plans made while another step's result was outstanding
        self.launched_ahead = 0  # steps launched while another step's tokens were unfinished
        self.max_tokens_per_step = 0

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        delta = self.scheduler.add_request(
            SubmitRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=params, reply_stream="r"
            )
        )
        assert delta is None, delta

    def run(
        self,
        max_steps: int = 10_000,
        *,
        pipeline: bool = False,
        overlap: bool = False,
        ahead: int = 2,
    ) -> dict[str, Generation]:
        """Step until every submitted request finished; outputs assembled from the deltas.

        With `pipeline`, steps are planned as the scheduler service does with async
        scheduling: step N+1 is planned (and executed: the worker runs what it receives) before
        step N's result is applied, whenever the core allows planning ahead. With `overlap`
        (implies pipeline) the runner is driven as the worker service drives a GPU: step N+1 is
        launched before step N is finished, its inputs fed from N's tokens on the device.
        `ahead`: plans out at once when pipelining (the scheduler's schedule_ahead); the
        runner still holds at most one unfinished step when the next launches, as the worker
        service does (it answers step N before it reads the plan after N + 1)."""
        pipeline = pipeline or overlap
        out: dict[str, Generation] = {}
        pending: deque[tuple[StepPlan, StepResult | LaunchedStep]] = deque()
        for _ in range(max_steps):
            depth = ahead if pipeline and self.scheduler.can_pipeline() else 1
            while len(pending) < depth:
                plan = self.scheduler.schedule()
                if plan is None:
                    break
                self.max_tokens_per_step = max(
                    self.max_tokens_per_step, sum(plan.num_scheduled_tokens.values())
                )
                pending.append((plan, self._launch(plan, pending, overlap)))
                self.planned_ahead += len(pending) > 1
            if not pending:
                if not self.scheduler.has_work():
                    return out
                raise AssertionError("scheduler has work but planned nothing")
            plan, step = pending.popleft()
            result = self.runner.finish(step) if isinstance(step, LaunchedStep) else step
            update = self.scheduler.update_from_output(plan, result)
            self.steps += 1
            for deltas in update.deltas.values():
                for delta in deltas:
                    self._apply(out.setdefault(delta.request_id, Generation()), delta)
        raise AssertionError(f"not finished after {max_steps} steps")

    def _launch(
        self,
        plan: StepPlan,
        pending: deque[tuple[StepPlan, StepResult | LaunchedStep]],
        overlap: bool,
    ) -> StepResult | LaunchedStep:
        """What the worker service does with a plan: steps that may not stay in flight are
        finished before and right after their launch (services/worker/service.py)."""
        may_overlap = overlap and self.runner.can_overlap(plan)
        if not may_overlap:
            for i, (earlier, step) in enumerate(pending):
                if isinstance(step, LaunchedStep):
                    pending[i] = (earlier, self.runner.finish(step))
            return self.runner.execute(plan)
        for i, (earlier, step) in enumerate(list(pending)[:-1]):  # all but the newest one
            if isinstance(step, LaunchedStep):
                pending[i] = (earlier, self.runner.finish(step))
        self.launched_ahead += any(isinstance(step, LaunchedStep) for _, step in pending)
        return self.runner.launch(plan)

    @staticmethod
    def _apply(gen: Generation, delta: RequestDelta) -> None:
        assert delta.start_index == len(gen.token_ids), "deltas must arrive in order, no gaps"
        gen.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            gen.logprobs.extend(delta.logprobs)
        if delta.top_token_ids is not None and delta.top_logprobs is not None:
            gen.top_token_ids.extend(delta.top_token_ids)
            gen.top_logprobs.extend(delta.top_logprobs)
        if delta.num_cached_tokens:
            gen.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            assert gen.prompt_logprobs is None, "prompt logprobs come once"
            gen.prompt_logprobs = list(delta.prompt_logprobs)
            gen.prompt_top_token_ids = list(delta.prompt_top_token_ids or [])
            gen.prompt_top_logprobs = list(delta.prompt_top_logprobs or [])
            gen.prompt_ranks = list(delta.prompt_ranks or [])
        if delta.finish_reason is not None:
            gen.finish_reason = delta.finish_reason

    def generate(
        self,
        prompts: dict[str, list[int]],
        params: SamplingParams,
        *,
        pipeline: bool = False,
        overlap: bool = False,
        ahead: int = 2,
    ) -> dict[str, Generation]:
        for rid, prompt in prompts.items():
            self.submit(rid, prompt, params)
        return self.run(pipeline=pipeline, overlap=overlap, ahead=ahead)
