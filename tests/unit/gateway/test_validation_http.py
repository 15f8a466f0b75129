"""Every validation rule: the bad value gets a 400 naming the field, and nothing is queued.

Runs the real router (ASGI) with the SmolLM2 tokenizer and a real Redis behind the bus; the
context is cut to 64 tokens so "too long" is cheap to build.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

MAX_LEN = 64
VOCAB = 49152
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


pytestmark = pytest.mark.harness(max_model_len=MAX_LEN, max_n=4, max_logprobs=5)


def msg(role: str = "user", content: Any = "Hi") -> dict[str, Any]:
    return {"role": role, "content": content}


CALLED = {"name": "f", "arguments": "{}"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


CASES: list[tuple[str, dict[str, Any], str]] = [
    # context length
    ("completions", {"prompt": list(range(10, 10 + MAX_LEN))}, "prompt"),
    ("chat", {"messages": [msg(content="word " * MAX_LEN)]}, "messages"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": MAX_LEN}, "max_tokens"),
    ("chat", {"max_tokens": None, "max_completion_tokens": MAX_LEN}, "max_completion_tokens"),
    ("chat", {"max_tokens": -1}, "max_tokens"),
    ("completions", {"max_tokens": "many"}, "max_tokens"),
    # prompt forms
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": ["a", 1]}, "prompt"),
    ("completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("completions", {"prompt": [1, -5]}, "prompt"),
    ("completions", {"prompt": [1, VOCAB]}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    # sampling ranges
    ("completions", {"n": 0}, "n"),
    ("chat", {"n": 5}, "n"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.01}, "top_p"),
    ("chat", {"temperature": -0.1}, "temperature"),
    ("chat", {"temperature": 2.5}, "temperature"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"seed": 2**63}, "seed"),
    ("completions", {"min_tokens": 5}, "min_tokens"),
    ("completions", {"min_tokens": -1}, "min_tokens"),
    # logprobs
    ("completions", {"logprobs": 6}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    # stop
    ("completions", {"stop": [1]}, "stop"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"stop": ""}, "stop"),
    ("completions", {"stop": 5}, "stop"),
    ("completions", {"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("completions", {"stop_token_ids": "2"}, "stop_token_ids"),
    # logit bias
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("completions", {"logit_bias": [1]}, "logit_bias"),
    # messages
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [msg(role="wizard")]}, "messages[0].role"),
    ("chat", {"messages": [msg(), msg(role="tool")]}, "messages[1].tool_call_id"),
    (
        "chat",
        {"messages": [{**msg(), "tool_calls": [{"id": "c", "function": CALLED}]}]},
        "messages[0].tool_calls",
    ),
    ("chat", {"messages": [{**msg(), "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
    (
        "chat",
        {"messages": [msg(), {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[1].tool_calls[0].function",
    ),
    ("chat", {"messages": [msg(content=None)]}, "messages[0].content"),
    (
        "chat",
        {"messages": [msg(content=[{"type": "image_url", "image_url": {}}])]},
        "messages[0].content",
    ),
    ("chat", {"messages": [msg(content=[{"type": "text"}])]}, "messages[0].content"),
    ("chat", {"messages": "Hi"}, "messages"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    (
        "chat",
        {"continue_final_message": True, "add_generation_prompt": False},
        "continue_final_message",
    ),
    # tools
    ("chat", {"tools": [TOOL]}, "tool_choice"),  # "auto" (the default) without a parser
    ("chat", {"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # no tools
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat", {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice.function.name",
    ),
    ("chat", {"tools": [TOOL, TOOL], "tool_choice": "required"}, "tools[1].function.name"),
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "two words"}}], "tool_choice": "none"},
        "tools[0].function.name",
    ),
    ("chat", {"tools": [{"type": "retrieval", "function": TOOL["function"]}]}, "tools[0].type"),
    ("chat", {"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0].function"),
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    ("chat", {"tools": [TOOL] * 129, "tool_choice": "none"}, "tools"),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
        "tool_choice",
    ),
    ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ("chat", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    # streaming
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    # unsupported OpenAI fields are refused, not ignored
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"best_of": 2}, "best_of"),
    # structured outputs (shape only)
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ("chat", {"structured_outputs": {}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("chat", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("chat", {"structured_outputs": {"regex": "  "}}, "structured_outputs.regex"),
    (
        "chat",
        {"structured_outputs": {"structural_tag": "[1]"}},
        "structured_outputs.structural_tag",
    ),
    (
        "chat",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    # vLLM's extra sampling parameters
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
    ("chat", {"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ("chat", {"allowed_token_ids": "1"}, "allowed_token_ids"),
    ("completions", {"bad_words": ["ok", "  "]}, "bad_words"),
    ("chat", {"bad_words": ["w"] * 129}, "bad_words"),
    ("chat", {"bad_words": [" word" * 70]}, "bad_words"),  # more tokens than a word may have
    ("completions", {"bad_words": "word"}, "bad_words"),
    ("completions", {"prompt_logprobs": 6}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("chat", {"truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens"),
    # truncated to the whole context: no room left for output
    ("completions", {"prompt": list(range(10, 110)), "truncate_prompt_tokens": MAX_LEN}, "prompt"),
    ("completions", {"cache_salt": ""}, "cache_salt"),
    ("chat", {"priority": 2**31}, "priority"),
    # the default fcfs policy takes no priority; a stream gets the 400 too, not an error event
    ("chat", {"priority": -1}, "priority"),
    ("completions", {"priority": 1, "stream": True}, "priority"),
    ("chat", {"skip_special_tokens": "maybe"}, "skip_special_tokens"),
    # routed experts on a dense model
    ("chat", {"return_routed_experts": True}, "return_routed_experts"),
    ("completions", {"routed_experts_prompt_start": 0}, "routed_experts_prompt_start"),
]


@pytest.mark.parametrize(
    ("endpoint", "patch", "param"), CASES, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(CASES)]
)
async def test_bad_value_is_a_400_naming_the_field(
    gateway: GatewayHarness, endpoint: str, patch: dict[str, Any], param: str
) -> None:
    base = COMPLETION if endpoint == "completions" else CHAT
    body = {**base, **patch}
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    resp = await gateway.http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["message"]
    assert await gateway.entries_added(gateway.streams.requests) == 0


async def test_unknown_model_is_a_404(gateway: GatewayHarness) -> None:
    resp = await gateway.http.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"})
    assert resp.status_code == 404
    assert resp.json()["error"]["param"] == "model"
    assert resp.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
async def test_body_that_is_not_a_json_object_is_a_400(gateway: GatewayHarness, raw: bytes) -> None:
    resp = await gateway.http.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


async def test_unknown_fields_are_ignored(gateway: GatewayHarness) -> None:
    resp = await gateway.http.post(
        "/tokenize", json={"model": MODEL_NAME, "prompt": "Hi", "no_such_field": {"x": 1}}
    )
    assert resp.status_code == 200


async def test_boundary_values_are_accepted(gateway: GatewayHarness) -> None:
    """The extreme valid values pass and reach the stream as given."""
    prompt = list(range(100, 100 + MAX_LEN - 1))  # leaves room for exactly one token
    stops = [f"s{i}" for i in range(16)]
    body = {
        **COMPLETION,
        "prompt": prompt,
        "max_tokens": 1,
        "top_p": 1.0,
        "temperature": 2.0,
        "n": 4,
        "logprobs": 5,
        "stop": stops,
        "seed": 2**63 - 8,
    }
    task = asyncio.create_task(gateway.http.post("/v1/completions", json=body))
    submits = [await gateway.next_submit() for _ in range(4)]
    assert all(s.prompt_token_ids == prompt and s.sampling.max_tokens == 1 for s in submits)
    assert all(s.sampling.temperature == 2.0 and s.sampling.logprobs == 5 for s in submits)
    await gateway.reply(
        *(
            RequestDelta(
                request_id=s.request_id,
                start_index=0,
                token_ids=[42],
                logprobs=[-1.0],
                top_token_ids=[42, 1, 3, 4, 5],
                top_logprobs=[-1.0, -2, -3, -4, -5],
                finish_reason="length",
            )
            for s in submits
        )
    )
    resp = await task
    assert resp.status_code == 200, resp.text
    assert [c["finish_reason"] for c in resp.json()["choices"]] == ["length"] * 4
