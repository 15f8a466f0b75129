"""The Responses API's translation layer: a Responses body -> the chat body that serves it
(api/responses_api.py), every 400 and the field it names (the Responses model's own, and the
chat path's renamed), and the chat path's answers -> Response objects (api/responses_output.py)
and stream events (stream/responses_events.py).

The chat answers translated here are real: the gateway's chat route (ASGI, a real Redis, the
SmolLM2 tokenizer) answers the same token ids whole and streamed, with no parser and with the
qwen3 reasoning and hermes tool-call parsers, and the scheduler's side is played with those
ids. Every Response and event is validated by the `openai` client's own models, strictly
(`model_validate`, not the client's lenient parsing of what the server sends).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)
from pydantic import BaseModel

from services.gateway.api.errors import OpenAIError
from services.gateway.api.protocol_openai import ChatCompletionRequest, parse_request
from services.gateway.api.responses_api import (
    PASSED_THROUGH,
    ResponsesRequest,
    responses_error,
    responses_param,
    to_chat_body,
)
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.planner import Planner
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.generation import StreamError
from services.gateway.stream.responses_events import ResponseEvents, response_events
from shared.config import GatewaySettings
from shared.protocol import SubmitRequest
from tests.unit.gateway.harness import (
    ALTERNATIVE_IDS,
    MODEL_NAME,
    GatewayHarness,
    gateway_harness,
)

DEPTH = 64
#: A small context, so that "too long" is cheap to build.
MAX_LEN = 64
EVENT_MODELS: dict[str, type[BaseModel]] = {
    "response.created": ResponseCreatedEvent,
    "response.in_progress": ResponseInProgressEvent,
    "response.completed": ResponseCompletedEvent,
    "response.incomplete": ResponseIncompleteEvent,
    "response.failed": ResponseFailedEvent,
    "error": ResponseErrorEvent,
    "response.output_item.added": ResponseOutputItemAddedEvent,
    "response.output_item.done": ResponseOutputItemDoneEvent,
    "response.content_part.added": ResponseContentPartAddedEvent,
    "response.content_part.done": ResponseContentPartDoneEvent,
    "response.output_text.delta": ResponseTextDeltaEvent,
    "response.output_text.done": ResponseTextDoneEvent,
    "response.reasoning_text.delta": ResponseReasoningTextDeltaEvent,
    "response.reasoning_text.done": ResponseReasoningTextDoneEvent,
    "response.function_call_arguments.delta": ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": ResponseFunctionCallArgumentsDoneEvent,
}
DELTAS = {
    "response.output_text.delta": "response.output_text.done",
    "response.reasoning_text.delta": "response.reasoning_text.done",
    "response.function_call_arguments.delta": "response.function_call_arguments.done",
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "strict": False},
]


#: Every chat body the translation writes is a stream with usage last.
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}


def request(**fields: Any) -> ResponsesRequest:
    return parse_request(ResponsesRequest, json.dumps(fields).encode(), max_depth=DEPTH)


def chat_of(**fields: Any) -> dict[str, Any]:
    body = to_chat_body(request(**fields))
    # Whatever the translation writes, the chat endpoint's own model takes.
    parse_request(ChatCompletionRequest, json.dumps(body).encode(), max_depth=DEPTH)
    return body


# --- the chat body ----------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert chat_of(input="Hi") == {
        "messages": [{"role": "user", "content": "Hi"}],
        "parallel_tool_calls": True,
        **STREAMED,
    }
    assert chat_of(input="Hi", instructions="Be brief.")["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_input_items_become_the_conversation() -> None:
    weather = {"city": "Paris"}
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "Answer in French."},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather"},
                {"type": "input_text", "text": "and time in Paris?"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}
            ],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": json.dumps(weather),
            "status": "completed",
        },
        {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "18 C"},
        {
            "type": "function_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "noon"}],
        },
        {"role": "assistant", "content": "18 C at noon."},
        {"role": "system", "content": "Check again."},
        {"type": "function_call", "call_id": "call_c", "name": "get_time", "arguments": "{}"},
        {"role": "user", "content": "Thanks"},
    ]

    def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        function = {"name": name, "arguments": arguments}
        return {"id": call_id, "type": "function", "function": function}

    assert chat_of(input=items, instructions="Be brief.")["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather"},
                {"type": "text", "text": "and time in Paris?"},
            ],
        },
        # the reasoning is dropped; the calls join the text the model wrote before them
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": [
                call("call_a", "get_weather", json.dumps(weather)),
                call("call_b", "get_time", "{}"),
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "content": "18 C at noon."},
        {"role": "system", "content": "Check again."},
        {"role": "assistant", "content": None, "tool_calls": [call("call_c", "get_time", "{}")]},
        {"role": "user", "content": "Thanks"},
    ]


#: One valid value for each chat sampling field a Responses body passes on.
EXTRAS: dict[str, Any] = {
    "top_k": 5,
    "min_p": 0.1,
    "seed": 7,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "stop": ["\n\n"],
    "stop_token_ids": [2],
    "min_tokens": 1,
    "logit_bias": {"11": 1.5},
    "ignore_eos": True,
    "allowed_token_ids": [11, 12, 13],
    "bad_words": ["Paris"],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "truncate_prompt_tokens": 8,
    "cache_salt": "tenant-a",
    "priority": 3,
    "structured_outputs": {"regex": "[a-z]+"},
}


def test_settings_and_vllm_extras_reach_the_chat_body() -> None:
    assert set(EXTRAS) == PASSED_THROUGH  # a new chat sampling field gets a case here
    # Chat fields the Responses API names otherwise, sets itself, or has no place for.
    not_passed = {
        "n": 2,
        "max_tokens": 3,
        "response_format": {"type": "json_object"},
        "stream_options": {"include_usage": False},
        "messages": [{"role": "user", "content": "not this"}],
        "logprobs": True,
        "top_logprobs": 2,
        "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_routed_experts": True,
        "routed_experts_prompt_start": 0,
        "chat_template_kwargs": {"x": 1},
    }
    chat = chat_of(
        input="Hi",
        model=MODEL_NAME,
        max_output_tokens=9,
        temperature=0.5,
        top_p=0.9,
        user="u-1",
        store=True,
        metadata={"team": "a"},
        **EXTRAS,
        **not_passed,
    )
    assert chat == {
        **EXTRAS,
        "messages": [{"role": "user", "content": "Hi"}],
        "model": MODEL_NAME,
        "max_completion_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "user": "u-1",
        "parallel_tool_calls": True,
        **STREAMED,
    }


def test_reasoning_effort_is_the_chat_reasoning_effort() -> None:
    assert chat_of(input="Hi", reasoning={"effort": "low"})["reasoning_effort"] == "low"
    assert "reasoning_effort" not in chat_of(input="Hi", reasoning={"summary": "auto"})


def test_text_format_is_the_response_format() -> None:
    assert "response_format" not in chat_of(input="Hi", text={"format": {"type": "text"}})
    assert "response_format" not in chat_of(input="Hi", text={})
    assert chat_of(input="Hi", text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"
    }
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    assert chat_of(input="Hi", text={"format": fmt})["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
    }
    described = {"type": "json_schema", "schema": WEATHER, "description": "the weather"}
    assert chat_of(input="Hi", text={"format": described})["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": WEATHER, "description": "the weather"},
    }


def test_function_tools_and_tool_choice() -> None:
    chat = chat_of(
        input="Hi",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
    )
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
        },
        {"type": "function", "function": {"name": "get_time", "strict": False}},
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert chat["parallel_tool_calls"] is False
    for choice in ("none", "auto", "required"):
        assert chat_of(input="Hi", tools=TOOLS, tool_choice=choice)["tool_choice"] == choice
    assert "tool_choice" not in chat_of(input="Hi", tools=TOOLS)  # the chat path's default


def test_the_chat_body_is_always_a_stream_with_usage() -> None:
    """A Response is built from the chat stream's chunks whether or not it is streamed."""
    for stream in (True, False):
        chat = chat_of(input="Hi", stream=stream)
        assert {k: chat[k] for k in STREAMED} == STREAMED


def test_logprobs_are_asked_for_by_include() -> None:
    include = ["message.output_text.logprobs"]
    chat = chat_of(input="Hi", include=include, top_logprobs=5)
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 5)
    chat = chat_of(input="Hi", include=["reasoning.encrypted_content", *include])
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 0)
    # top_logprobs alone returns none (OpenAI's rule, and vLLM's)
    assert "logprobs" not in chat_of(input="Hi", top_logprobs=5)


# --- 400s -------------------------------------------------------------------------------------

MSG = {"role": "user", "content": "Hi"}
IMAGE = {"type": "input_image", "image_url": "https://example.com/cat.png"}
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({}, "input", "Field required"),
    ({"input": 5}, "input", "must be a string or a non-empty list"),
    ({"input": []}, "input", "must be a string or a non-empty list"),
    ({"input": ["Hi"]}, "input", "item 0 must be an object"),
    ({"input": [IMAGE]}, "input[0].type", "'input_image' items are not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "not supported"),
    ({"input": [MSG, {"type": "web_search_call"}]}, "input[1].type", "not supported"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}, IMAGE]}]},
        "input[0].content",
        "part 1: only input_text and output_text parts are supported, got 'input_image'",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content",
        "got 'input_file'",
    ),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "Input should be"),
    ({"input": [{"role": "user"}]}, "input[0].content", "Field required"),
    ({"input": [{"content": "Hi"}]}, "input[0].role", "Field required"),
    (
        {"input": [MSG, {"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[1].call_id",
        "Field required",
    ),
    (
        {"input": [MSG, {"type": "function_call_output", "call_id": "c", "output": [IMAGE]}]},
        "input[1].output",
        "only input_text parts are supported",
    ),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    (
        {"input": "Hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
        "tools[0].type",
        "only function tools",
    ),
    (
        {"input": "Hi", "tools": [*TOOLS, {"type": "mcp", "server_label": "x"}]},
        "tools[2].type",
        "only function tools",
    ),
    ({"input": "Hi", "tools": [{"type": "function"}]}, "tools[0].name", "Field required"),
    ({"input": "Hi", "tool_choice": {"type": "file_search"}}, "tool_choice", "must be"),
    ({"input": "Hi", "tool_choice": {"type": "function"}}, "tool_choice", "needs the function"),
    ({"input": "Hi", "tool_choice": "sometimes"}, "tool_choice", "must be"),
    (
        {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
        "text.format",
        "needs a 'schema'",
    ),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "Input should"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "response store"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation", "response store"),
    ({"input": "Hi", "conversation": {"id": "conv_1"}}, "conversation", "response store"),
    ({"input": "Hi", "background": True}, "background", "response store"),
    ({"input": "Hi", "prompt": {"id": "pmpt_1"}}, "prompt", "saved prompts"),
    ({"input": "Hi", "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"input": "Hi", "reasoning": {"effort": "max"}}, "reasoning.effort", "Input should be"),
    ({"input": "Hi", "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ({"input": "Hi", "truncation": "auto"}, "truncation", "never trimmed"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"input": "Hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16 pairs"),
    ({"input": "Hi", "metadata": {"k": "v" * 513}}, "metadata", "values up to 512"),
    ({"input": "Hi", "metadata": {"k": 1}}, "metadata.k", "valid string"),
    ({"input": "Hi", "stream": "sometimes"}, "stream", "valid boolean"),
    ({"input": "Hi", "instructions": ["be brief"]}, "instructions", "valid string"),
]


@pytest.mark.parametrize(("fields", "param", "message"), REFUSED)
def test_what_cannot_be_served_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(OpenAIError) as caught:
        to_chat_body(request(**fields))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert caught.value.message.startswith(f"{param}: ")
    assert message in caught.value.message


def test_what_needs_no_store_is_accepted() -> None:
    accepted = request(
        input="Hi",
        store=True,
        background=False,
        previous_response_id=None,
        include=["reasoning.encrypted_content"],
        truncation="disabled",
    )
    assert to_chat_body(accepted)["messages"] == [MSG]


@pytest.fixture(scope="module")
def planner(tokenizer: PromptTokenizer, smollm2_dir: Path) -> Planner:
    settings = GatewaySettings(
        model=str(smollm2_dir), served_model_name=MODEL_NAME, max_model_len=MAX_LEN
    )
    return Planner(tokenizer, ModelInfo.from_hf_dir(MODEL_NAME, smollm2_dir, MAX_LEN), settings)


def chat_path_error(planner: Planner, **fields: Any) -> OpenAIError:
    """The chat path's 400 for a Responses body, as the Responses route reports it."""
    body = json.dumps(to_chat_body(request(**{"input": "Hi", **fields}))).encode()
    with pytest.raises(OpenAIError) as caught:
        planner.chat(body)
    return responses_error(caught.value)


CHAT_REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"max_output_tokens": MAX_LEN}, "max_output_tokens", "'max_output_tokens' is too large"),
    ({"input": "word " * MAX_LEN}, "input", "maximum context length"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_k": -5}, "top_k", "greater than or equal to -1"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"stop": ""}, "stop", "must not be empty"),
    ({"min_tokens": 5, "max_output_tokens": 2}, "min_tokens", "must not exceed max_output_tokens"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"model": "another-model"}, "model", "does not exist"),
    (
        {"text": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
        "text.format.schema",
        "invalid JSON schema",
    ),
    (
        {"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "give either text.format or structured_outputs",
    ),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name", "match pattern"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].name", "declared twice"),
    (
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]},
        "tools[0].parameters",
        "invalid JSON schema",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_news"}},
        "tool_choice.name",
        "not among the tools",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS}, "tool_choice", "MESHLLM_TOOL_CALL_PARSER"),
    (
        {"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
        "tool_choice",
        "cannot be combined with response_format",
    ),
]


@pytest.mark.parametrize(("fields", "param", "message"), CHAT_REFUSED)
def test_a_chat_path_400_names_the_responses_field(
    planner: Planner, fields: dict[str, Any], param: str, message: str
) -> None:
    error = chat_path_error(planner, **fields)
    assert error.param == param
    assert message.replace("response_format", "text.format") in error.message
    assert "max_completion_tokens" not in error.message


def test_chat_params_are_renamed_and_others_kept() -> None:
    renamed = {
        "max_completion_tokens": "max_output_tokens",
        "response_format": "text.format",
        "response_format.json_schema": "text.format",
        "response_format.json_schema.schema": "text.format.schema",
        "response_format.json_schema.schema.properties": "text.format.schema.properties",
        "messages": "input",
        "messages[3].content": "input",
        "tools[12].function.parameters": "tools[12].parameters",
        "tools[0].function.name": "tools[0].name",
        "tool_choice.function.name": "tool_choice.name",
        "tools": "tools",
        "tool_choice": "tool_choice",
        "top_k": "top_k",
        "structured_outputs.regex": "structured_outputs.regex",
        "messages_extra": "messages_extra",
    }
    assert {chat: responses_param(chat) for chat in renamed} == renamed
    assert responses_param(None) is None
    error = responses_error(
        OpenAIError(429, "busy", type_="rate_limit_error", code="x", headers={"Retry-After": "1"})
    )
    assert (error.status, error.type, error.code, error.headers) == (
        429,
        "rate_limit_error",
        "x",
        {"Retry-After": "1"},
    )


# --- answers: the chat path's, translated -------------------------------------------------------


@pytest.fixture
async def plain(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> AsyncIterator[GatewayHarness]:
    async with gateway_harness(redis_url, tokenizer, smollm2_dir) as harness:
        yield harness


@pytest.fixture
async def parsing(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> AsyncIterator[GatewayHarness]:
    async with gateway_harness(
        redis_url, tokenizer, smollm2_dir, reasoning_parser="qwen3", tool_call_parser="hermes"
    ) as harness:
        yield harness


async def reply(gw: GatewayHarness, text: str, finish: str, top: int | None) -> SubmitRequest:
    """Answer the next request with `text`'s ids one token a delta (then the end-of-turn token
    when it stops), as a scheduler does; with logprobs when the request asked for them."""
    ids = gw.tokenizer.encode(text, add_special_tokens=False)
    submit = await gw.next_submit()
    assert submit.sampling.logprobs == top
    await gw.reply_tokens(submit, ids, finish, top=top)
    return submit


@dataclass
class Answered:
    whole: dict[str, Any]  # the Response to the request not streamed
    events: list[dict[str, Any]]  # the stream's events, to the same tokens
    submit: SubmitRequest  # what the scheduler got for the first


async def answers(gw: GatewayHarness, text: str, finish: str = "stop", **fields: Any) -> Answered:
    """POST /v1/responses with `fields`, not streamed and then streamed, each answered with
    `text`. The Response is validated by the `openai` client's model, and so is every event."""
    req = request(**fields)
    top = (req.top_logprobs or 0) if req.output_logprobs else None
    posted = asyncio.create_task(gw.http.post("/v1/responses", json=fields))
    submit = await reply(gw, text, finish, top)
    whole = await posted
    assert whole.status_code == 200, whole.text
    Response.model_validate(whole.json())
    posted = asyncio.create_task(gw.http.post("/v1/responses", json={**fields, "stream": True}))
    await reply(gw, text, finish, top)
    streamed = await posted
    assert streamed.headers["content-type"].startswith("text/event-stream")
    return Answered(whole.json(), parsed_events(streamed.text), submit)


async def chat_chunks(gw: GatewayHarness, req: ResponsesRequest, text: str) -> list[dict[str, Any]]:
    """The chat stream's chunks serving `req`, answered with `text`."""
    posted = asyncio.create_task(gw.http.post("/v1/chat/completions", json=to_chat_body(req)))
    await reply(gw, text, "stop", None)
    lines = (await posted).text.splitlines()
    return [json.loads(line.removeprefix("data: ")) for line in lines if line[:7] == "data: {"]


async def events_of(
    req: ResponsesRequest, chunks: list[dict[str, Any] | StreamError]
) -> list[dict[str, Any]]:
    """The Responses stream of `chunks`, read back from its SSE text."""

    async def fed() -> AsyncIterator[dict[str, Any] | StreamError]:
        for chunk in chunks:
            yield chunk

    translator = ResponseEvents(req, response_id="resp_1", created_at=1, model=MODEL_NAME)
    return parsed_events("".join([event async for event in response_events(fed(), translator)]))


def parsed_events(text: str) -> list[dict[str, Any]]:
    """SSE `event:`/`data:` pairs, each event validated by its `openai` model."""
    blocks = text.split("\n\n")
    assert blocks[-1] == ""  # every event ends with a blank line
    events = []
    for block in blocks[:-1]:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENT_MODELS[event["type"]].model_validate(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def replayed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items a client assembles from the events, checking their order: opened one
    at a time, in output_index order; deltas and part events only for the open item; each
    `.done` says what its deltas said; the final response lists the closed items."""
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    for event in events[:2]:
        assert event["response"]["status"] == "in_progress"
        assert event["response"]["output"] == []
    closed: list[dict[str, Any]] = []
    item: dict[str, Any] | None = None
    said = ""
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert item is None and event["output_index"] == len(closed)
            item, said = event["item"], ""
            assert item["status"] == "in_progress"
            continue
        assert item is not None and event["output_index"] == len(closed)
        if "item_id" in event:
            assert event["item_id"] == item["id"]
        if kind in DELTAS:
            said += event["delta"]
        elif kind in DELTAS.values():
            assert event.get("text", event.get("arguments")) == said
        elif kind == "response.content_part.added":
            assert event["part"]["text"] == "" and said == ""
        elif kind == "response.content_part.done":
            assert event["part"]["text"] == said
        else:
            assert kind == "response.output_item.done"
            done = event["item"]
            assert (done["id"], done["type"]) == (item["id"], item["type"])
            closed.append(done)
            item = None
    assert item is None
    assert events[-1]["response"]["output"] == closed
    return closed


def text_deltas(events: list[dict[str, Any]], kind: str) -> str:
    return "".join(e["delta"] for e in events if e["type"] == kind)


def same_but_ids(streamed: dict[str, Any], whole: dict[str, Any]) -> None:
    """Two Responses to the same tokens are equal but for their ids (the items' and the tool
    calls') and creation times."""

    def scrubbed(response: dict[str, Any]) -> str:
        out = {**response, "id": "", "created_at": 0}
        text = json.dumps(out, sort_keys=True)
        return re.sub(r'"((rs|msg|fc)_[0-9a-f]{32}|call_[0-9a-f]+)"', '"id"', text)

    assert scrubbed(streamed) == scrubbed(whole)


async def test_a_text_answer(plain: GatewayHarness) -> None:
    answer = "The capital of France is Paris."
    fields = {"model": MODEL_NAME, "input": "Capital of France?", "instructions": "Be brief."}
    answered = await answers(plain, answer, **fields)
    whole = answered.whole
    chat_id = answered.submit.request_id.removesuffix("-0")  # its choice 0
    assert whole["id"] == "resp_" + chat_id.removeprefix("chatcmpl-")
    assert (whole["object"], whole["status"], whole["model"]) == (
        "response",
        "completed",
        MODEL_NAME,
    )
    assert abs(whole["created_at"] - time.time()) < 60
    (message,) = whole["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert (message["role"], message["status"]) == ("assistant", "completed")
    assert message["content"] == [
        {"type": "output_text", "text": answer, "annotations": [], "logprobs": []}
    ]
    assert Response.model_validate(whole).output_text == answer
    prompt = len(answered.submit.prompt_token_ids)
    output = len(plain.tokenizer.encode(answer, add_special_tokens=False)) + 1
    assert whole["usage"] == {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }
    assert whole["incomplete_details"] is None and whole["error"] is None
    assert whole["instructions"] == "Be brief."
    assert (whole["store"], whole["tools"], whole["tool_choice"]) == (False, [], "none")
    assert whole["text"] == {"format": {"type": "text"}}
    assert whole["reasoning"] == {"effort": None, "summary": None}

    events = answered.events
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in replayed(events)] == ["message"]
    assert text_deltas(events, "response.output_text.delta") == answer
    assert len([e for e in events if e["type"] == "response.output_text.delta"]) > 3
    same_but_ids(events[-1]["response"], whole)


async def test_an_answer_cut_by_max_output_tokens_is_incomplete(plain: GatewayHarness) -> None:
    answer = "The capital of France is"
    n = len(plain.tokenizer.encode(answer, add_special_tokens=False))
    answered = await answers(
        plain, answer, "length", input="Capital of France?", max_output_tokens=n
    )
    whole = answered.whole
    assert (whole["status"], whole["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert whole["max_output_tokens"] == n and whole["usage"]["output_tokens"] == n
    assert whole["output"][0]["status"] == "incomplete"
    events = answered.events
    assert events[-1]["type"] == "response.incomplete"
    assert replayed(events)[0]["status"] == "incomplete"
    same_but_ids(events[-1]["response"], whole)


async def test_an_empty_answer_is_an_empty_message(plain: GatewayHarness) -> None:
    answered = await answers(plain, "", input="Say nothing.")
    whole = answered.whole
    assert [(i["type"], i["content"][0]["text"]) for i in whole["output"]] == [("message", "")]
    assert [i["type"] for i in replayed(answered.events)] == ["message"]
    same_but_ids(answered.events[-1]["response"], whole)


async def test_reasoning_is_its_own_item(parsing: GatewayHarness) -> None:
    thought = "The user asks for the capital of France. It is Paris."
    answered = await answers(
        parsing, f"<think>\n{thought}\n</think>\n\nParis.", input="Capital of France?"
    )
    whole = answered.whole
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": f"\n{thought}\n"}]
    assert message["content"][0]["text"] == "\n\nParis."
    assert Response.model_validate(whole).output_text == "\n\nParis."
    thinking = parsing.tokenizer.encode(f"<think>\n{thought}\n</think>", add_special_tokens=False)
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": len(thinking)}

    events = answered.events
    assert [i["type"] for i in replayed(events)] == ["reasoning", "message"]
    assert text_deltas(events, "response.reasoning_text.delta") == f"\n{thought}\n"
    assert text_deltas(events, "response.output_text.delta") == "\n\nParis."
    same_but_ids(events[-1]["response"], whole)


async def test_tool_calls_are_function_call_items(parsing: GatewayHarness) -> None:
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    written = "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>\n'
        for name, args in calls
    )
    answered = await answers(
        parsing,
        f"<think>\nTwo tools.\n</think>\n\nChecking.\n{written}",
        input="Weather and time in Paris?",
        tools=TOOLS,
        tool_choice="auto",
    )
    whole = answered.whole
    assert whole["status"] == "completed"
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    for item, (name, args) in zip(whole["output"][2:], calls, strict=True):
        assert item["id"].startswith("fc_") and item["status"] == "completed"
        assert item["call_id"].startswith("call_") and item["name"] == name
        assert json.loads(item["arguments"]) == args
    assert len({item["call_id"] for item in whole["output"][2:]}) == 2
    assert whole["output"][1]["content"][0]["text"] == "\n\nChecking.\n"
    assert whole["tools"] == [
        {"type": "function", "description": "Weather", "strict": None, **TOOLS[0]},
        {"type": "function", "description": None, "parameters": None, **TOOLS[1]},
    ]
    assert whole["tool_choice"] == "auto"

    events = answered.events
    items = replayed(events)
    assert [i["type"] for i in items] == kinds
    assert [json.loads(i["arguments"]) for i in items[2:]] == [args for _, args in calls]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["name"], i["arguments"]) for i in added[2:]] == [(n, "") for n, _ in calls]
    same_but_ids(events[-1]["response"], whole)


async def test_text_after_a_tool_call_is_a_second_message_in_both_shapes(
    parsing: GatewayHarness,
) -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    answered = await answers(
        parsing, f"Checking.\n{call}Done.", input="Time?", tools=TOOLS, tool_choice="auto"
    )
    kinds = [(i["type"], i.get("content", [{}])[0].get("text")) for i in answered.whole["output"]]
    assert kinds == [("message", "Checking.\n"), ("function_call", None), ("message", "\nDone.")]
    same_but_ids(answered.events[-1]["response"], answered.whole)


async def test_logprobs_of_the_message_text(parsing: GatewayHarness) -> None:
    """include message.output_text.logprobs: each token of the message's text with its logprob
    and top_logprobs alternatives; the reasoning's tokens are not listed."""
    answer = "Paris, of course."
    answered = await answers(
        parsing,
        f"<think>\nEasy.\n</think>\n\n{answer}",
        input="Capital of France?",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    tok = parsing.tokenizer
    _, message = answered.whole["output"]
    text = message["content"][0]["text"]
    logprobs = message["content"][0]["logprobs"]
    # The message's tokens: the last ones, after the reasoning's and its end marker's, and the
    # end-of-turn token last (the chat endpoint lists it too).
    marked = len(tok.encode("<think>\nEasy.\n</think>", add_special_tokens=False))
    n = len(tok.encode(f"<think>\nEasy.\n</think>\n\n{answer}", add_special_tokens=False)) + 1
    assert "".join(entry["token"] for entry in logprobs[:-1]) == text == f"\n\n{answer}"
    assert logprobs[-1]["token"] == tok.hf.eos_token
    assert [entry["logprob"] for entry in logprobs] == [
        -(p + 1) / 8 for p in range(n - len(logprobs), n)
    ]
    assert n - len(logprobs) == marked
    for entry in logprobs:
        assert entry["bytes"] == list(entry["token"].encode())
        alternatives = entry["top_logprobs"]
        assert [a["token"] for a in alternatives] == [tok.decode([i]) for i in ALTERNATIVE_IDS[:2]]
        assert [a["logprob"] for a in alternatives] == [entry["logprob"] - j for j in range(2)]
    events = answered.events
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [x for e in deltas for x in e["logprobs"]] == logprobs
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == logprobs
    assert answered.whole["top_logprobs"] == 2
    same_but_ids(events[-1]["response"], answered.whole)


async def test_top_logprobs_alone_returns_no_logprobs(plain: GatewayHarness) -> None:
    answered = await answers(plain, "Paris.", input="Capital of France?", top_logprobs=3)
    assert answered.whole["output"][0]["content"][0]["logprobs"] == []
    assert answered.whole["top_logprobs"] == 3


async def test_a_failure_mid_stream_fails_the_response(plain: GatewayHarness) -> None:
    req = request(input="Capital of France?")
    chunks = await chat_chunks(plain, req, "The capital of France is Paris.")
    cut: list[dict[str, Any] | StreamError] = [
        *chunks[:4],
        StreamError("the engine failed", "internal_server_error", 500),
    ]
    events = await events_of(req, cut)
    *_, done, error, failed = events
    said = text_deltas(events, "response.output_text.delta")
    assert said and done["type"] == "response.output_item.done"
    assert done["item"]["status"] == "incomplete"
    assert done["item"]["content"][0]["text"] == said
    assert error == {
        "type": "error",
        "sequence_number": error["sequence_number"],
        "code": "internal_server_error",
        "message": "the engine failed",
        "param": None,
    }
    assert failed["type"] == "response.failed"
    response = failed["response"]
    assert response["status"] == "failed" and response["output"] == [done["item"]]
    assert response["error"] == {"code": "server_error", "message": "the engine failed"}
    # A request the engine could not serve at all fails as an invalid prompt, with no item.
    refused = StreamError("no token allowed", "invalid_request_error", 400)
    events = await events_of(req, [chunks[0], refused])
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert events[-1]["response"]["error"]["code"] == "invalid_prompt"
