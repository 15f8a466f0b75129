"""Scheduler -> gateway: new tokens of running requests, batched per reply stream."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import Message, Struct, register
from shared.protocol.packed import PackedFloat32, PackedInt32

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestDelta(Struct):
    """Output tokens of one request, starting at output index `start_index`.

    Indexes let the gateway drop repeats: after a scheduler restart a request is regenerated from
    the start (seeded, so identical) and the gateway keeps only indexes it has not yet seen.
    """

    request_id: str
    start_index: int = Field(ge=0)
    token_ids: PackedInt32 = Field(default_factory=list)
    logprobs: PackedFloat32 | None = None
    top_token_ids: PackedInt32 | None = None
    top_logprobs: PackedFloat32 | None = None
    routed_experts: PackedInt32 | None = None  # [positions, moe_layers, top_k] row-major
    routed_experts_shape: list[int] | None = None
    # The first delta of a request that asked for prompt logprobs: one per prompt token after
    # the first (the logprob of token i given tokens < i), top-k rows as for logprobs.
    prompt_logprobs: PackedFloat32 | None = None
    prompt_top_token_ids: PackedInt32 | None = None
    prompt_top_logprobs: PackedFloat32 | None = None
    prompt_ranks: PackedInt32 | None = None  # each one's rank in its distribution (1 = best)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop/eos token that finished it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # "invalid_request_error" when the request itself cannot be served (its structured-output
    # grammar allows no token of the model's vocabulary): the gateway answers 400, not 500.
    # Omitted when unset (the codec drops defaults), so older readers still decode the rest.
    error_type: Literal["invalid_request_error"] | None = None


@register
class TokenDelta(Message):
    TYPE = "token_delta"
    VERSION = 1

    scheduler_id: str
    deltas: list[RequestDelta]
