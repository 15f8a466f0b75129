"""Checks across fields, against the settings and model, and against the tokenized prompt.

Each failed check is a 400 naming the field. They run before anything is queued: a request that
reaches the requests stream is one the scheduler can run as given. Nothing is clamped: an
out-of-range value is refused, never quietly adjusted.
"""

from __future__ import annotations

from services.gateway.api.errors import OpenAIError, invalid_request
from services.gateway.api.protocol_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from services.gateway.plan.model_info import ModelInfo
from shared.config import GatewaySettings


def check_request(
    req: CompletionRequest | ChatCompletionRequest, settings: GatewaySettings, model: ModelInfo
) -> None:
    """Everything that does not need the prompt's tokens."""
    _check_common(req, settings, model)
    if isinstance(req, CompletionRequest):
        _check_completion(req, settings)
        # Token-id prompts are decoded (for echo) before check_prompt sees them: an id past the
        # vocabulary must be refused first, or the decoder fails on it.
        for prompt in req.prompt:
            # max() runs at C speed over a long id list; pydantic already refused negatives.
            if isinstance(prompt, list) and prompt and max(prompt) >= model.vocab_size:
                _check_token_id(max(prompt), model, "prompt")
    else:
        _check_chat(req, settings)


def _check_common(req: SamplingFields, settings: GatewaySettings, model: ModelInfo) -> None:
    if req.n > settings.max_n:
        raise invalid_request(f"n must be between 1 and {settings.max_n}, got {req.n}", "n")
    if req.priority and settings.scheduling_policy == "fcfs":
        # The scheduler refuses it too; refused here, a stream gets a 400 instead of a 200
        # whose only event is the error.
        raise invalid_request(
            "priority scheduling is not enabled (MESHLLM_SCHEDULING_POLICY=fcfs); "
            f"priority must be 0, got {req.priority}",
            "priority",
        )
    if req.stream_options is not None and not req.stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", "stream_options"
        )
    for token in req.stop_token_ids or []:
        _check_token_id(token, model, "stop_token_ids")
    for token in req.logit_bias or {}:
        _check_token_id(token, model, "logit_bias")
    for token in req.allowed_token_ids or []:
        _check_token_id(token, model, "allowed_token_ids")
    if req.prompt_logprobs is not None:
        if req.prompt_logprobs > settings.max_logprobs:
            raise invalid_request(
                f"prompt_logprobs must be at most {settings.max_logprobs}, got "
                f"{req.prompt_logprobs}",
                "prompt_logprobs",
            )
        if req.stream:  # vLLM's rule: they come whole, with the first token
            raise invalid_request(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
    keep = req.truncate_prompt_tokens
    if keep is not None and keep > model.max_model_len:
        raise invalid_request(
            f"truncate_prompt_tokens ({keep}) is larger than the model's maximum context length "
            f"({model.max_model_len})",
            "truncate_prompt_tokens",
        )
    if req.routed_experts_prompt_start is not None and not req.return_routed_experts:
        raise invalid_request(
            "routed_experts_prompt_start needs return_routed_experts to be true",
            "routed_experts_prompt_start",
        )
    if req.return_routed_experts and not model.is_moe:
        raise invalid_request(
            f"model {model.name!r} has no MoE layers: it has no routed experts to return",
            "return_routed_experts",
        )


def _check_completion(req: CompletionRequest, settings: GatewaySettings) -> None:
    if req.suffix:
        raise invalid_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != 1:
        raise invalid_request("best_of is not supported; use n", "best_of")
    if req.logprobs is not None and req.logprobs > settings.max_logprobs:
        raise invalid_request(
            f"logprobs must be at most {settings.max_logprobs}, got {req.logprobs}", "logprobs"
        )
    _check_min_tokens(req.min_tokens, req.max_tokens, "max_tokens")


def _check_chat(req: ChatCompletionRequest, settings: GatewaySettings) -> None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.top_logprobs > settings.max_logprobs:
            raise invalid_request(
                f"top_logprobs must be at most {settings.max_logprobs}, got {req.top_logprobs}",
                "top_logprobs",
            )
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise invalid_request(
                "continue_final_message needs add_generation_prompt to be false",
                "continue_final_message",
            )
        if req.messages[-1].role != "assistant":
            raise invalid_request(
                "continue_final_message needs a final assistant message", "continue_final_message"
            )
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    _check_min_tokens(req.min_tokens, req.max_new_tokens, param)


def _check_min_tokens(min_tokens: int, max_tokens: int | None, param: str) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid_request(
            f"min_tokens ({min_tokens}) must not exceed {param} ({max_tokens})", "min_tokens"
        )


def _check_token_id(token: int, model: ModelInfo, param: str) -> None:
    if not 0 <= token < model.vocab_size:
        raise invalid_request(
            f"token id {token} is outside the vocabulary [0, {model.vocab_size})", param
        )


def prompt_too_long(num_tokens: int, model: ModelInfo, prompt_param: str) -> OpenAIError:
    """The 400 for a prompt that leaves no room for output in the context."""
    return invalid_request(
        f"This model's maximum context length is {model.max_model_len} tokens. However, your "
        f"prompt has {num_tokens} tokens, which leaves no room for output. Shorten the prompt.",
        prompt_param,
    )


def check_prompt(
    prompt_ids: list[int],
    max_tokens: int | None,
    model: ModelInfo,
    *,
    prompt_param: str,
    max_tokens_param: str,
    min_tokens: int = 0,
    default_max_tokens: int | None = None,
) -> int:
    """Check a tokenized prompt against the context; return the max_tokens to run with.

    `max_tokens` None (omitted or null) takes `default_max_tokens`, capped by the room the
    context leaves (completions: OpenAI's 16, as vLLM caps it), or with no default the whole
    room (chat). Only a value the client gave is refused for being too large: the default was
    not theirs. The prompt must leave room for at least one new token, and for `min_tokens`
    (which check_request could compare only with an explicit max_tokens).
    """
    if not prompt_ids:
        raise invalid_request("the prompt is empty", prompt_param)
    limit = model.max_model_len
    if len(prompt_ids) >= limit:  # before the per-token loop: a long prompt is refused at once
        raise prompt_too_long(len(prompt_ids), model, prompt_param)
    if min(prompt_ids) < 0 or max(prompt_ids) >= model.vocab_size:
        for token in prompt_ids:  # name the first one outside
            _check_token_id(token, model, prompt_param)
    if max_tokens is None:
        room = limit - len(prompt_ids)
        if default_max_tokens is not None and default_max_tokens <= room:
            implicit, what = default_max_tokens, f"the default {max_tokens_param}"
        else:
            implicit, what = room, "the tokens the context leaves for output"
        if min_tokens > implicit:
            raise invalid_request(
                f"min_tokens ({min_tokens}) is more than {what} ({implicit})", "min_tokens"
            )
        return implicit
    if len(prompt_ids) + max_tokens > limit:
        raise invalid_request(
            f"'{max_tokens_param}' is too large: {max_tokens}. This model's maximum context "
            f"length is {limit} tokens and your request has {len(prompt_ids)} input tokens "
            f"({max_tokens} > {limit} - {len(prompt_ids)}).",
            max_tokens_param,
        )
    return max_tokens


def check_routed_experts_start(start: int, prompt_len: int) -> None:
    """CONTRACTS.md: `0 <= start <= prompt_len`, a closed interval (start == prompt_len asks
    for no prompt rows). Reject, never clamp: a clamped offset would return rows for positions
    the client did not ask for."""
    if not 0 <= start <= prompt_len:
        raise invalid_request(
            f"routed_experts_prompt_start must be within [0, {prompt_len}] (the prompt has "
            f"{prompt_len} tokens), got {start}",
            "routed_experts_prompt_start",
        )
