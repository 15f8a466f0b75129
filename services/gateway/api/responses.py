"""OpenAI response bodies and SSE chunks, built from a plan and its choices.

Shapes follow OpenAI exactly (the `openai` client parses them): `text_completion` /
`chat.completion` bodies, `text_completion` / `chat.completion.chunk` stream chunks, usage
`{prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details: {cached_tokens}}`
(OpenAI's and vLLM's field for prompt tokens served from cache). With reasoning or tools in
play a chat choice's text is read for them (stream/message_reader.py): `reasoning_content` and
`tool_calls` in a body's message, and in a stream's deltas. meshllm adds `routed_experts`
to a choice when it was asked for: one entry per returned position (prompt positions from the
requested start, then one per generated token), each a list over MoE layers of the top-k expert
ids.

vLLM's `prompt_logprobs`, when asked for, are a completions choice's `prompt_logprobs` and a
chat body's top-level `prompt_logprobs` (vLLM's places). Logprobs are rendered by
logprobs_format.py.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.api.logprobs_format import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs,
)
from services.gateway.plan.request_plan import RequestPlan
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.choice_assembler import ChoiceAssembler, ChoiceUpdate
from services.gateway.stream.message_reader import MessageDelta, message_reader
from services.gateway.stream.tool_calls import joined_calls

DONE = "data: [DONE]\n\n"


#: One encoder for every chunk: json.dumps with non-default options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_ENCODER.encode(payload)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def plan_usage(plan: RequestPlan, choices: list[ChoiceAssembler]) -> dict[str, Any]:
    """Prompt tokens are counted once per prompt (not per choice), and so are the cached ones:
    those of each prompt's first choice, the one that computed (or found) its prefix, from the
    group's own cache or the Redis tier alike (the scheduler counts both at admission)."""
    cached = sum(choices[p * plan.n].num_cached_tokens for p in range(len(plan.prompts)))
    counted = usage(plan.num_prompt_tokens, sum(c.num_tokens for c in choices), cached)
    if plan.reasoning:  # OpenAI's field: how many of the completion tokens were reasoning
        reasoning = sum(c.reasoning_tokens for c in choices)
        counted["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return counted


def token_names(plan: RequestPlan, tok: PromptTokenizer) -> TokenNames:
    return TokenNames(tok, as_ids=plan.tokens_as_ids)


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + then[key] for key in first}


# --- full bodies -----------------------------------------------------------------------------


def completion_body(
    plan: RequestPlan, choices: list[ChoiceAssembler], tok: PromptTokenizer
) -> dict[str, Any]:
    names = token_names(plan, tok)
    out = []
    for choice in choices:
        prefix = plan.prompt_of(choice.index).text if plan.echo else ""
        item: dict[str, Any] = {
            "index": choice.index,
            "text": prefix + choice.text,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
        }
        if plan.logprobs is not None:
            item["logprobs"] = completion_logprobs(names, choice.logprobs, len(prefix))[0]
            if plan.echo:
                ids = plan.prompt_of(choice.index).token_ids
                prompt = echo_logprobs(names, ids, choice.prompt_logprobs, plan.logprobs)
                item["logprobs"] = _joined(prompt, item["logprobs"])
        if plan.prompt_logprobs is not None:
            item["prompt_logprobs"] = prompt_logprobs(
                names, choice.prompt_logprobs, plan.prompt_logprobs
            )
        if plan.return_routed_experts:
            item["routed_experts"] = choice.routed_rows
        out.append(item)
    return {
        "id": plan.request_id,
        "object": "text_completion",
        "created": plan.created,
        "model": plan.model,
        "choices": out,
        "usage": plan_usage(plan, choices),
    }


def chat_body(
    plan: RequestPlan, choices: list[ChoiceAssembler], tok: PromptTokenizer
) -> dict[str, Any]:
    names = token_names(plan, tok)
    out = []
    for choice in choices:
        message, finish_reason = _chat_message(plan, choice)
        item: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs(names, choice.logprobs)
            if plan.logprobs is not None
            else None,
            "finish_reason": finish_reason,
        }
        if plan.return_routed_experts:
            item["routed_experts"] = choice.routed_rows
        out.append(item)
    body = {
        "id": plan.request_id,
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.model,
        "choices": out,
        "usage": plan_usage(plan, choices),
    }
    if plan.prompt_logprobs is not None:  # one prompt, whatever n: the first choice's
        body["prompt_logprobs"] = prompt_logprobs(
            names, choices[0].prompt_logprobs, plan.prompt_logprobs
        )
    return body


def _chat_message(plan: RequestPlan, choice: ChoiceAssembler) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish reason of a whole choice: its text read for reasoning
    and tool calls when the gateway or the request puts them in play (the stream's reader
    over the whole text at once)."""
    reader = message_reader(plan.tools, plan.reasoning)
    if reader is None or choice.finish_reason is None:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    output = reader.feed(choice.text).then(reader.finish())
    choice.count_reasoning(reader.reasoning_chars)
    message: dict[str, Any] = {"role": "assistant", "content": output.content}
    if plan.reasoning:
        message["reasoning_content"] = output.reasoning or None
        message["content"] = output.content or None
    if reader.called:
        # OpenAI: content is null beside calls unless the model also wrote something.
        message["content"] = output.content if output.content.strip() else None
        message["tool_calls"] = joined_calls(output.parts)
    return message, reader.finish_reason(choice.finish_reason)


# --- stream chunks ---------------------------------------------------------------------------


def _chunk(plan: RequestPlan, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": plan.request_id,
        "object": "text_completion" if plan.kind == "completion" else "chat.completion.chunk",
        "created": plan.created,
        "model": plan.model,
        "choices": choices,
    }
    if plan.include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
    return body


def chat_role_chunk(plan: RequestPlan, index: int) -> dict[str, Any]:
    delta = {"role": "assistant", "content": ""}
    return _chunk(plan, [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])


def update_chunk(
    plan: RequestPlan,
    index: int,
    update: ChoiceUpdate,
    tok: PromptTokenizer,
    *,
    prefix: str = "",
    text_offset: int = 0,
    message: MessageDelta | None = None,
    finish_reason: str | None = None,
    prompt: ChoiceAssembler | None = None,
) -> tuple[dict[str, Any], int]:
    """One choice's update as a chunk; `prefix` is echoed prompt text (completions, first
    chunk). Returns the chunk and the text offset after it (completions logprobs).
    With reasoning or tools in play, `message` (the update's text read for them) is the delta,
    and `finish_reason` the reason the reader gives (a chat choice that called tools).
    `prompt`: the choice whose echoed prompt this chunk carries, with its prompt logprobs."""
    text = prefix + update.text
    names = token_names(plan, tok)
    item: dict[str, Any]
    if plan.kind == "completion":
        item = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": update.finish_reason,
        }
        if plan.logprobs is not None:
            item["logprobs"], _ = completion_logprobs(
                names, update.logprobs, text_offset + len(prefix)
            )
            if prompt is not None:
                ids = plan.prompt_of(index).token_ids
                echoed = echo_logprobs(names, ids, prompt.prompt_logprobs, plan.logprobs)
                item["logprobs"] = _joined(echoed, item["logprobs"])
    else:
        delta: dict[str, Any] = {"content": text} if text or update.finish_reason is None else {}
        if message is not None:
            delta = message.delta()
        item = {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(names, update.logprobs)
            if plan.logprobs is not None
            else None,
            "finish_reason": finish_reason or update.finish_reason,
        }
    if plan.return_routed_experts:
        item["routed_experts"] = update.routed_rows
    return _chunk(plan, [item]), text_offset + len(text)


def usage_chunk(plan: RequestPlan, choices: list[ChoiceAssembler]) -> dict[str, Any]:
    body = _chunk(plan, [])
    body["usage"] = plan_usage(plan, choices)
    return body


def error_event(message: str, type_: str = "internal_server_error", code: int = 500) -> str:
    """A mid-stream failure: OpenAI-style error object as an SSE event (then [DONE])."""
    return sse({"error": {"message": message, "type": type_, "param": None, "code": code}})
