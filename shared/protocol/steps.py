"""Scheduler <-> worker messages: one StepPlan per step, one StepResult back.

A StepPlan is a diff against the worker's persistent batch (vLLM v1's SchedulerOutput shape):
requests the worker has not seen come in full (`new_requests`), requests it already holds come
as the blocks appended since the last step (`cached_requests`). The worker remembers the tokens
it sampled itself, so running requests never resend their history.
"""

from __future__ import annotations

from pydantic import Field

from shared.protocol.base import Message, Struct, register
from shared.protocol.kv_transfer import KVTransfer
from shared.protocol.packed import Blob, PackedFloat32, PackedInt32
from shared.protocol.requests import SamplingParams


class NewRequestData(Struct):
    """A request entering the worker's batch (first schedule, or resumed after preemption).

    `token_ids` holds every token known so far (prompt, then output already generated before a
    preemption); `num_computed_tokens` of them already have KV in the listed blocks (prefix hit).
    """

    request_id: str
    token_ids: PackedInt32
    num_prompt_tokens: int = Field(ge=1)
    block_ids: list[PackedInt32]  # one list per KV cache group
    num_computed_tokens: int = Field(ge=0)
    sampling: SamplingParams
    return_routed_experts: bool = False


class CachedRequestData(Struct):
    """A request already in the worker's batch: blocks appended since the previous step."""

    request_id: str
    new_block_ids: list[PackedInt32]  # one list per KV cache group; empty lists if none
    num_computed_tokens: int = Field(ge=0)


@register
class StepPlan(Message):
    """What the worker runs this step.

    `num_scheduled_tokens[req]` tokens are computed for each scheduled request, starting at its
    `num_computed_tokens`. A request is sampled this step iff its computed tokens reach the end of
    its known tokens (prefill finished or decoding); otherwise it is a partial (chunked) prefill.
    """

    TYPE = "step_plan"
    VERSION = 1

    step_id: int = Field(ge=0)
    scheduler_id: str
    worker_incarnation: str = ""  # the worker this plan is for; others drop it
    # The scheduler process that made it: a worker seeing a new one (the scheduler restarted)
    # drops its batch, since the requests it holds belong to the dead scheduler's plans.
    scheduler_incarnation: str = ""
    new_requests: list[NewRequestData] = Field(default_factory=list)
    cached_requests: list[CachedRequestData] = Field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = Field(default_factory=dict)
    finished_request_ids: list[str] = Field(default_factory=list)  # drop from the batch
    preempted_request_ids: list[str] = Field(default_factory=list)  # drop; will come back as new
    # Structured outputs: one packed int32 bitmask row (ceil(vocab/32) words) per listed request.
    grammar_request_ids: list[str] = Field(default_factory=list)
    grammar_bitmask: Blob = b""
    # KV offload (shared/protocol/kv_transfer.py): stores run after this step's forward, loads
    # in the background; neither delays this step's compute.
    kv_stores: list[KVTransfer] = Field(default_factory=list)
    kv_loads: list[KVTransfer] = Field(default_factory=list)
    # Speculative decoding: draft tokens to verify, per decoding request. Such a request is
    # scheduled 1 + len(drafts) tokens (its last verified token, then the drafts) and returns
    # 1 .. len(drafts) + 1 tokens (accepted drafts, then the bonus/correction). A listed
    # grammar request gets 1 + len(drafts) consecutive bitmask rows (one per draft, then the
    # bonus row) instead of one.
    spec_token_ids: dict[str, PackedInt32] = Field(default_factory=dict)
    # Speculative decoding with the worker's own drafts (scheduler settings.async_scheduling):
    # lookahead slots per decoding request, planned before the previous step's result is back.
    # Such a request is scheduled 1 + slots tokens; the worker verifies up to `slots` of the
    # drafts it proposed for the request in its previous step (fewer, or none, leave slots
    # unused) from its own count of the request's computed tokens (the plan's
    # `num_computed_tokens` for it counts every earlier slot as accepted), and reports how
    # many it verified (SampledTokens.num_drafts). Every decode of such a request is listed,
    # with 0 slots too (nothing verified, the worker's own count still used). Never for a
    # grammar request (its drafts are validated by the scheduler: `spec_token_ids`).
    spec_lookahead: dict[str, int] = Field(default_factory=dict)


class SampledTokens(Struct):
    """Tokens sampled for one request this step (one, or more with speculative decoding)."""

    request_id: str
    token_ids: PackedInt32
    logprobs: PackedFloat32 | None = None  # logprob of each sampled token
    top_token_ids: PackedInt32 | None = None  # [len(token_ids) * k], row-major
    top_logprobs: PackedFloat32 | None = None  # same shape
    routed_experts: PackedInt32 | None = None  # [positions * moe_layers * top_k], row-major
    routed_experts_shape: list[int] | None = None  # [positions, moe_layers, top_k]
    # Prompt logprobs (SamplingParams.prompt_logprobs): entry j is the logprob of prompt token
    # prompt_logprobs_start + j + 1 given the tokens before it, for the positions computed since
    # the request's previous SampledTokens; top-k rows as for the sampled tokens.
    prompt_logprobs_start: int = Field(default=0, ge=0)
    prompt_logprobs: PackedFloat32 | None = None
    prompt_top_token_ids: PackedInt32 | None = None
    prompt_top_logprobs: PackedFloat32 | None = None
    prompt_ranks: PackedInt32 | None = None  # tokens at least as likely as the prompt's
    # Speculative decoding: the worker's drafts for this request's next step (unverified).
    draft_token_ids: PackedInt32 | None = None
    # Speculative decoding: drafts verified this step (the plan's, or the worker's own in
    # StepPlan.spec_lookahead slots); the first len(token_ids) - 1 of them were accepted.
    num_drafts: int = Field(default=0, ge=0)


@register
class StepResult(Message):
    TYPE = "step_result"
    VERSION = 1

    step_id: int = Field(ge=0)
    worker_id: str
    worker_incarnation: str = ""
    sampled: list[SampledTokens] = Field(default_factory=list)
    error: str | None = None  # the step failed; the scheduler recomputes its requests
    execute_ms: float = 0.0
