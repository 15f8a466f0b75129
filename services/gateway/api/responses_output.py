"""The Response object of POST /v1/responses and its output items (responses_events.py builds
them from the chat path's stream, for a streamed response and a whole one alike).

Shapes are OpenAI's (the `openai` client's `Response` model validates them). `output` holds, in
the order the model writes them: a reasoning item when a reasoning parser split off thinking
(its text as a `reasoning_text` part, no summary: vLLM's shape), a message item with one
`output_text` part (a second one when the model writes text again after a tool call), and one
`function_call` item per tool call (`call_id` is the chat call's
id, which a follow-up's function_call_output names). An answer with nothing in it is still an
(empty) message, so a client that reads `output[0]` finds one. A response cut short (by
max_output_tokens or the context) is `incomplete`, and so is its last item, the one that was
cut. The settings the request ran with are echoed, as OpenAI does; `store` is always false.
With `include: ["message.output_text.logprobs"]` an output_text part lists its tokens'
logprobs, each with `top_logprobs` alternatives.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from services.gateway.api.responses_api import ResponsesRequest

ItemStatus = Literal["in_progress", "completed", "incomplete"]
Status = Literal["in_progress", "completed", "incomplete", "failed"]


def response_id(chat_id: str) -> str:
    """The response's id: the chat request's own hex, by which the logs know the request."""
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def new_item_id(prefix: Literal["rs", "msg", "fc"]) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: ItemStatus) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`logprobs`: the chat path's logprobs entries (token, logprob, bytes, top_logprobs), which
    are the Responses API's too."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    item_id: str, text: str, status: ItemStatus, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [output_text(text, logprobs)] if status != "in_progress" else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: ItemStatus
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def status_of(finish_reason: str | None) -> tuple[Status, dict[str, Any] | None]:
    """A response's status and incomplete_details from its chat finish reason. An abort (the
    scheduler ended the request) is incomplete for no reason OpenAI names."""
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "incomplete", None


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage in the Responses API's names. Cache writes are OpenAI's explicit prompt
    caching, which meshllm's prefix cache does not need."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage["total_tokens"],
    }


def response_object(
    req: ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    model: str,
    status: Status,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_details: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object, with `usage` in the Responses API's names already."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "incomplete_details": incomplete_details,
        "error": error,
        "model": model,
        "output": output,
        "usage": usage,
        **_settings(req),
    }


def _settings(req: ResponsesRequest) -> dict[str, Any]:
    """What the request ran with, as OpenAI echoes it (OpenAI's defaults where it was silent:
    the chat path's too)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        text_format: dict[str, Any] = {"type": fmt.type if fmt is not None else "text"}
    else:
        text_format = fmt.model_dump(by_alias=True, exclude_none=True)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tools": [tool.model_dump() for tool in req.tools or []],
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "parallel_tool_calls": req.parallel_tool_calls,
        "text": {"format": text_format},
        "truncation": "disabled",
        "store": False,
        "background": False,
        "previous_response_id": None,
        "metadata": req.metadata,
        "user": req.user,
        "top_logprobs": req.top_logprobs,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
    }
