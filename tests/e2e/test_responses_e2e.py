"""The Responses API end to end: the openai client's `responses.create` -> gateway (translated to
a chat request, planned, answered in the Responses API's shape) -> grammar service ->
scheduler -> worker, SmolLM2, every service its own process.

The Responses endpoint is a translation of the chat endpoint, so with greedy decoding the chat
endpoint's answer to the same conversation is the expected value: the same text, the same
usage, the same call arguments. Nothing expected is written into the test. Schemas bound what
the tiny model could ramble on (string lengths, enums), as in test_structured_outputs.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import ResponseTextDeltaEvent

from tests.e2e.conftest import E2E_ENV
from tests.e2e.test_tool_calls import WEATHER
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

INSTRUCTIONS = "You are a geography teacher. Answer briefly."
QUESTION = "What is the capital of France?"
CONVERSATION: Any = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": QUESTION},
]
MAX_TOKENS = 24
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "country": {"enum": ["France", "Italy", "Spain"]},
    },
    "required": ["city", "country"],
}
TOOLS: Any = [
    {"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}
]
CHAT_TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER},
    }
]
ASK: Any = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    """With the grammar service (text.format, a named tool choice) and the hermes parser."""
    services = ("gateway", "scheduler", "worker", "grammar")
    env = {**E2E_ENV, "MESHLLM_TOOL_CALL_PARSER": "hermes"}
    with Mesh(services=services, env=env) as m:
        yield m


def test_greedy_output_is_the_chat_endpoints(client: openai.OpenAI, model_name: str) -> None:
    chat = client.chat.completions.create(
        model=model_name, messages=CONVERSATION, temperature=0, max_tokens=MAX_TOKENS
    )
    resp = client.responses.create(
        model=model_name,
        input=QUESTION,
        instructions=INSTRUCTIONS,
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    )
    expected = chat.choices[0].message.content
    assert expected and "Paris" in expected
    assert resp.output_text == expected
    assert resp.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert chat.usage is not None and resp.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    # The same conversation as input items, the instructions a developer message.
    items: Any = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    again = client.responses.create(
        model=model_name, input=items, temperature=0, max_output_tokens=MAX_TOKENS
    )
    assert again.output_text == expected


def greedy_question(model_name: str) -> dict[str, Any]:
    """CONVERSATION as a Responses request, greedy."""
    return {
        "model": model_name,
        "input": QUESTION,
        "instructions": INSTRUCTIONS,
        "temperature": 0,
        "max_output_tokens": MAX_TOKENS,
    }


def test_a_stream_says_the_same(client: openai.OpenAI, model_name: str) -> None:
    kw = greedy_question(model_name)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    last = events[-1]
    assert last.type == (
        "response.completed" if whole.status == "completed" else "response.incomplete"
    )
    assert last.response.output_text == whole.output_text  # type: ignore[union-attr]
    assert last.response.usage == whole.usage  # type: ignore[union-attr]


def test_logprobs_are_the_chat_endpoints(client: openai.OpenAI, model_name: str) -> None:
    """include message.output_text.logprobs: the chat endpoint's logprobs of the same greedy
    tokens, whole and streamed."""
    chat = client.chat.completions.create(
        model=model_name, messages=CONVERSATION, temperature=0, max_tokens=MAX_TOKENS,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    kw = {**greedy_question(model_name), "include": ["message.output_text.logprobs"]}
    kw["top_logprobs"] = 3
    resp = client.responses.create(**kw)
    (part,) = resp.output[0].content  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert [entry.model_dump() for entry in part.logprobs] == expected
    assert all(len(entry.top_logprobs or []) == 3 for entry in part.logprobs)
    events = list(client.responses.create(stream=True, **kw))
    streamed = [
        entry.model_dump(include={"token", "logprob"})
        for e in events
        if isinstance(e, ResponseTextDeltaEvent)
        for entry in e.logprobs
    ]
    assert streamed == [{"token": x["token"], "logprob": x["logprob"]} for x in expected]


def test_max_output_tokens_cuts_the_response(client: openai.OpenAI, model_name: str) -> None:
    resp = client.responses.create(
        model=model_name, input=QUESTION, temperature=0, max_output_tokens=3
    )
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 3


def test_text_format_json_schema_gives_valid_json(client: openai.OpenAI, model_name: str) -> None:
    fmt: Any = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    ask = "Name the capital of France as JSON."
    resp = client.responses.create(
        model=model_name, input=ask, text={"format": fmt}, temperature=0, max_output_tokens=80
    )
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), CITY)
    chat_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY, "strict": True},
    }
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": ask}],
        response_format=chat_format,
        temperature=0,
        max_tokens=80,
    )
    assert resp.output_text == chat.choices[0].message.content


#: A forced call of get_weather, greedy.
CALL: dict[str, Any] = {
    "input": ASK,
    "tools": TOOLS,
    "tool_choice": {"type": "function", "name": "get_weather"},
    "temperature": 0,
    "max_output_tokens": 60,
}


def test_a_named_tool_choice_gives_a_function_call(client: openai.OpenAI, model_name: str) -> None:
    resp = client.responses.create(model=model_name, **CALL)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    chat = client.chat.completions.create(
        model=model_name,
        messages=ASK,  # type: ignore[arg-type]
        tools=CHAT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    (chat_call,) = chat.choices[0].message.tool_calls or []
    assert call.arguments == chat_call.function.arguments  # type: ignore[union-attr]

    with client.responses.stream(model=model_name, **CALL) as stream:
        final = stream.get_final_response()
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments


def test_a_follow_up_with_the_call_and_its_output(client: openai.OpenAI, model_name: str) -> None:
    first = client.responses.create(model=model_name, **CALL)
    (call,) = first.output
    assert call.type == "function_call"
    result = "18 degrees and sunny"
    follow_up: Any = [
        *ASK,
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    resp = client.responses.create(
        model=model_name,
        input=follow_up,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    )
    assert resp.output_text and [item.type for item in resp.output] == ["message"]
    # The chat conversation with that call and result: the same prompt, the same answer.
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    messages: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    chat = client.chat.completions.create(
        model=model_name,
        messages=messages,
        tools=CHAT_TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert chat.usage is not None and resp.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content
    # The result is in the prompt: the question alone is shorter.
    alone = client.responses.create(
        model=model_name, **{**CALL, "tool_choice": "none", "max_output_tokens": 1}
    )
    assert alone.usage is not None and resp.usage.input_tokens > alone.usage.input_tokens + 10


def test_an_unsupported_feature_is_a_400(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model_name, input=QUESTION, previous_response_id="resp_1")
    assert caught.value.param == "previous_response_id"
    assert "response store" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model_name, input=QUESTION, tools=[{"type": "web_search"}])
    assert caught.value.param == "tools[0].type"
