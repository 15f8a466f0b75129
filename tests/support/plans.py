"""A minimal scheduler for tests: builds StepPlans for given prompts and loops a ModelRunner.

It does what the real scheduler does at the worker boundary, simply: allocates block ids from a
free list, splits prompts into chunks under a per-step token budget (chunked prefill mixed with
other requests' decodes), sends new requests in full and running ones as diffs, finishes them
at max_tokens or an eos token, and optionally reuses full prompt blocks of earlier requests
(prefix caching: a new request arrives with num_computed_tokens > 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.worker.runner.model_runner import ModelRunner
from shared.protocol import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
)


def new_request(
    request_id: str,
    tokens: list[int],
    blocks: list[int],
    computed: int = 0,
    sampling: SamplingParams | None = None,
) -> NewRequestData:
    """A new request whose `tokens` are all prompt, its blocks in one KV cache group; greedy
    unless `sampling` is given."""
    return NewRequestData(
        request_id=request_id,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        block_ids=[blocks],
        num_computed_tokens=computed,
        sampling=sampling or SamplingParams(temperature=0.0),
    )


@dataclass
class DriverRequest:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)  # prompt + outputs
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    known_to_worker: bool = False
    finished: bool = False
    num_cached_prompt_tokens: int = 0
    results: list[StepResult] = field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


class PlanDriver:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        token_budget: int = 512,
        chunk_size: int = 0,  # max prompt tokens per request per step; 0 = no limit
        prefix_caching: bool = False,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.prefix_caching = prefix_caching
        self.eos = set(eos_token_ids if eos_token_ids is not None else runner.config.eos_token_ids)
        self.free_blocks = list(range(runner.kv_cache.num_blocks))
        self.prefix_blocks: dict[tuple[int, ...], int] = {}
        self.requests: dict[str, DriverRequest] = {}
        self.step_id = 0
        self._finished_pending: list[str] = []
        self._preempted_pending: list[str] = []
        self.plans: list[StepPlan] = []
        self.results: list[StepResult] = []  # one per step, in step order

    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> DriverRequest:
        req = DriverRequest(request_id, list(prompt), sampling, tokens=list(prompt))
        if self.prefix_caching:
            self._match_prefix(req)
        self.requests[request_id] = req
        return req

    def preempt(self, request_id: str) -> None:
        """Drop a running request's KV; it is resent in full (prompt + outputs) next step."""
        req = self.requests[request_id]
        self._preempted_pending.append(request_id)
        self._release(req)
        req.num_computed = 0
        req.known_to_worker = False

    def _match_prefix(self, req: DriverRequest) -> None:
        # A hit is capped at len - 1 tokens: the last prompt token is recomputed for logits.
        limit = (len(req.tokens) - 1) // self.block_size
        for i in range(limit):
            block = self.prefix_blocks.get(tuple(req.tokens[: (i + 1) * self.block_size]))
            if block is None:
                break
            req.blocks.append(block)
        req.num_computed = len(req.blocks) * self.block_size
        req.num_cached_prompt_tokens = req.num_computed
        req.new_blocks = list(req.blocks)

    def _allocate(self, req: DriverRequest, upto_tokens: int) -> None:
        needed = -(-upto_tokens // self.block_size) - len(req.blocks)
        for _ in range(needed):
            block = self.free_blocks.pop(0)
            req.blocks.append(block)
            req.new_blocks.append(block)

    def _release(self, req: DriverRequest) -> None:
        cached = set(self.prefix_blocks.values())
        self.free_blocks.extend(b for b in req.blocks if b not in cached)
        req.blocks, req.new_blocks = [], []

    def _register_prefix(self, req: DriverRequest) -> None:
        full = min(req.num_computed, len(req.prompt)) // self.block_size
        for i in range(full):
            self.prefix_blocks.setdefault(
                tuple(req.tokens[: (i + 1) * self.block_size]), req.blocks[i]
            )

    def _block_ids(self, req: DriverRequest) -> list[list[int]]:
        """A new request's block lists, one per KV cache group (one group here; see
        tests/support/grouped_plans.py for several)."""
        return [list(req.blocks)]

    def _new_block_ids(self, req: DriverRequest) -> list[list[int]]:
        return [list(req.new_blocks)]

    def build_plan(self) -> StepPlan:
        plan = StepPlan(
            step_id=self.step_id,
            scheduler_id="test",
            finished_request_ids=self._finished_pending,
            preempted_request_ids=self._preempted_pending,
        )
        self._finished_pending, self._preempted_pending = [], []
        budget = self.token_budget
        for req in self.requests.values():
            if req.finished or budget == 0:
                continue
            remaining = len(req.tokens) - req.num_computed
            n = min(remaining, budget)
            if self.chunk_size and remaining > 1:
                n = min(n, self.chunk_size)
            if n <= 0:
                continue
            self._allocate(req, req.num_computed + n)
            if not req.known_to_worker:
                plan.new_requests.append(
                    NewRequestData(
                        request_id=req.request_id,
                        token_ids=list(req.tokens),
                        num_prompt_tokens=len(req.prompt),
                        block_ids=self._block_ids(req),
                        num_computed_tokens=req.num_computed,
                        sampling=req.sampling,
                    )
                )
                req.known_to_worker = True
            else:
                plan.cached_requests.append(
                    CachedRequestData(
                        request_id=req.request_id,
                        new_block_ids=self._new_block_ids(req),
                        num_computed_tokens=req.num_computed,
                    )
                )
            req.new_blocks = []
            plan.num_scheduled_tokens[req.request_id] = n
            budget -= n
        return plan

    def step(self) -> StepResult:
        plan = self.build_plan()
        self.plans.append(plan)
        result = self.runner.execute(plan)
        self.results.append(result)
        self.step_id += 1
        for req_id, n in plan.num_scheduled_tokens.items():
            req = self.requests[req_id]
            req.num_computed += n
            if self.prefix_caching:
                self._register_prefix(req)
        for sampled in result.sampled:
            req = self.requests[sampled.request_id]
            req.tokens.extend(sampled.token_ids)
            req.results.append(result)
            done = len(req.output) >= req.sampling.max_tokens
            if not req.sampling.ignore_eos and sampled.token_ids[-1] in self.eos:
                done = True
            if done:
                req.finished = True
                self._finished_pending.append(req.request_id)
                self._release(req)
        return result

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        """Step until every request finished; returns request id -> output tokens."""
        for _ in range(max_steps):
            if all(r.finished for r in self.requests.values()):
                break
            self.step()
        else:
            raise RuntimeError("requests did not finish")
        return {rid: r.output for rid, r in self.requests.items()}
