"""The scheduler's view of one request: its tokens, where it is in its life, its prefix hashes.

`all_token_ids` = prompt + outputs. `num_computed_tokens` of them have KV in the request's
blocks (on the worker); the rest are computed by coming steps. The scheduler advances
`num_computed_tokens` when it schedules a step (vLLM v1 does the same), so after `schedule()`
it counts the tokens that step computes. Block hashes cover every FULL block of
`all_token_ids` and are extended as output tokens arrive.
"""

from __future__ import annotations

import enum

from services.scheduler.prompt_logprobs import PromptLogprobsRecord
from services.scheduler.routed_experts import RoutedExpertsRecord
from shared.kv.block_hash import BlockHash, extend_block_hashes
from shared.protocol import FinishReason, SamplingParams, SubmitRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute (keeps its outputs)
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @classmethod
    def finished(cls, reason: FinishReason) -> RequestStatus:
        return _BY_REASON[reason]


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)
_BY_REASON: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}


class Request:
    __slots__ = (
        "all_token_ids",
        "arrival_seq",
        "arrival_time",
        "block_hashes",
        "block_size",
        "cache_salt",
        "first_delta_sent",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_lookahead_placeholders",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_step_failures",
        "output_token_ids",
        "priority",
        "prompt_logprobs",
        "reply_stream",
        "request_id",
        "return_routed_experts",
        "routed_experts",
        "sampling",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        reply_stream: str,
        block_size: int,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_prompt_start: int = 0,
        priority: int = 0,
        arrival_seq: int = 0,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.reply_stream = reply_stream
        self.arrival_time = arrival_time
        # Under the "priority" policy lower is served sooner, and the largest (priority,
        # arrival) running request is preempted first (waiting_queue.py); "fcfs" ignores both.
        self.priority = priority
        self.arrival_seq = arrival_seq  # the scheduler's intake order: ties of arrival_time
        self.cache_salt = cache_salt
        self.return_routed_experts = return_routed_experts
        # Rows collected for the reply (services/scheduler/routed_experts.py); None if not asked.
        self.routed_experts = (
            RoutedExpertsRecord(routed_experts_prompt_start, len(prompt_token_ids))
            if return_routed_experts
            else None
        )
        k = sampling.prompt_logprobs
        self.prompt_logprobs = (  # services/scheduler/prompt_logprobs.py; None if not asked
            PromptLogprobsRecord(k, len(prompt_token_ids)) if k is not None else None
        )
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose result has not come back (async scheduling:
        # the next step is planned before this one's result; the worker feeds them forward).
        self.num_output_placeholders = 0
        # Of those, the lookahead slots of steps in flight for the worker's own drafts (each
        # counted as accepted until its result: services/scheduler/spec/drafts.py).
        self.num_lookahead_placeholders = 0
        self.num_cached_tokens = -1  # prefix-hit tokens at first admission; -1 until admitted
        self.num_preemptions = 0
        self.num_step_failures = 0
        self.first_delta_sent = False
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, cache_salt)

    @classmethod
    def from_submit(cls, msg: SubmitRequest, block_size: int, arrival_seq: int = 0) -> Request:
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=msg.prompt_token_ids,
            sampling=msg.sampling,
            reply_stream=msg.reply_stream,
            block_size=block_size,
            arrival_time=msg.arrival_time,
            cache_salt=msg.cache_salt,
            return_routed_experts=msg.return_routed_experts,
            routed_experts_prompt_start=msg.routed_experts_prompt_start,
            priority=msg.priority,
            arrival_seq=arrival_seq,
        )

    @property
    def computes_every_position(self) -> bool:
        """Routed experts and prompt logprobs come from the forward of each prompt position:
        such a request never starts from a cached prefix (nor loads one from the KV tier)."""
        return self.return_routed_experts or self.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            extend_block_hashes(
                self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
