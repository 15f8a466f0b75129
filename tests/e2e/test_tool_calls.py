"""Tool calling end to end: the openai client -> gateway (template, tool choice, grammar, reading
the calls) -> grammar service -> scheduler -> worker, SmolLM2, every service its own process.

A named function and "required" are forced by grammars, so even this tiny model's calls parse
and validate. "auto" is read with the hermes parser; SmolLM2 was not trained to call tools, so
the auto tests hold its output to a call with a regex (structured outputs) and check what the
gateway makes of the text it generated, streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["tz"],
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} somewhere", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
WEATHER_CHOICE: Any = {"type": "function", "function": {"name": "get_weather"}}
#: The hermes format with room for the model's own words: text, then one call.
HERMES_CALL = (
    r'(Checking|Let me look)\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome|Oslo)", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    services = ("gateway", "scheduler", "worker", "grammar")
    env = {**E2E_ENV, "MESHLLM_TOOL_CALL_PARSER": "hermes"}
    with Mesh(services=services, env=env) as m:
        yield m


def valid_call(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, calls (joined from their parts) and finish reason of a streamed choice 0; each
    call's first part must carry its id, type and name."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            if part.index == len(calls):
                assert part.id and part.type == "function" and part.function.name
                calls.append({"id": part.id, "name": part.function.name, "arguments": ""})
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_named_function_call_parses_and_validates(client: openai.OpenAI, model_name: str) -> None:
    kw: Any = {"model": model_name, "messages": ASK, "tools": TOOLS, "max_tokens": 60}
    resp = client.chat.completions.create(tool_choice=WEATHER_CHOICE, temperature=0, **kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's reason for a forced call
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    valid_call("get_weather", call.function.arguments)

    content, calls, finish = streamed(client, tool_choice=WEATHER_CHOICE, temperature=0, **kw)
    assert (content, finish) == ("", "stop")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


def test_required_calls_are_the_tools_with_valid_arguments(
    client: openai.OpenAI, model_name: str
) -> None:
    kw: Any = {"model": model_name, "messages": ASK, "tools": TOOLS, "max_tokens": 120}
    resp = client.chat.completions.create(
        tool_choice="required", n=3, temperature=1.0, seed=7, **kw
    )
    for choice in resp.choices:
        calls = choice.message.tool_calls or []
        assert calls, choice
        for call in calls:
            valid_call(call.function.name, call.function.arguments)
        assert choice.finish_reason == "tool_calls"
        assert len({c.id for c in calls}) == len(calls)

    greedy = client.chat.completions.create(tool_choice="required", temperature=0, **kw)
    content, calls, finish = streamed(client, tool_choice="required", temperature=0, **kw)
    expected = [
        (c.function.name, c.function.arguments) for c in greedy.choices[0].message.tool_calls or []
    ]
    assert [(c["name"], c["arguments"]) for c in calls] == expected
    assert (content, finish) == ("", "tool_calls")


def test_auto_reads_the_calls_the_model_writes(client: openai.OpenAI, model_name: str) -> None:
    kw: Any = {
        "model": model_name,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 80,
        "extra_body": {"structured_outputs": {"regex": HERMES_CALL}},
    }
    resp = client.chat.completions.create(temperature=0, **kw)  # tool_choice: "auto"
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content in ("Checking.\n", "Let me look.\n")
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert valid_call("get_weather", call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    # The text the model generated, as the plain completion returns it, is what was read.
    raw = client.chat.completions.create(tool_choice="none", temperature=0, **kw)
    text = raw.choices[0].message.content or ""
    assert text.startswith(choice.message.content + "<tool_call>\n")
    assert json.loads(text.split("\n")[2])["arguments"] == json.loads(call.function.arguments)

    content, calls, finish = streamed(client, temperature=0, **kw)
    assert (content, finish) == (choice.message.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


def test_auto_without_a_call_is_an_answer(client: openai.OpenAI, model_name: str) -> None:
    resp = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0
    )
    choice = resp.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_a_conversation_with_a_tool_result_goes_on(client: openai.OpenAI, model_name: str) -> None:
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
    ]
    resp = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=16
    )
    assert resp.choices[0].message.content
    assert resp.choices[0].message.tool_calls is None
    # The result is in the prompt: the same chat without it is shorter.
    without = client.chat.completions.create(
        model=model_name, messages=messages[:1], tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert resp.usage and without.usage
    assert resp.usage.prompt_tokens > without.usage.prompt_tokens + 10
