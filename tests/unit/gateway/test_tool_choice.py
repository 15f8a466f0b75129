"""`tools` + `tool_choice` -> the plan (services/gateway/plan/tool_choice.py): which reading of
the output, and the grammar that forces the calls, compiled as the grammar service compiles it
and checked on the texts it must take and refuse. The 400s are in test_validation_http.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.api.errors import OpenAIError
from services.gateway.api.protocol_openai import ChatCompletionRequest
from services.gateway.plan.tool_choice import ToolCalling, plan_tools
from services.grammar.compiler_process import compile_grammar
from services.grammar.grammar_spec import compile_job
from shared.protocol import GrammarRef

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city"],
}
ZONE = {"type": "object", "properties": {"tz": {"$ref": "#/$defs/Zone"}}, "required": ["tz"]}
ZONE_DEFS = {"Zone": {"enum": ["UTC", "CET"]}}


def tool(name: str, parameters: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("get_weather", WEATHER), tool("get_time", {**ZONE, "$defs": ZONE_DEFS}), tool("ping")]


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, **fields}
    return ChatCompletionRequest.model_validate(body)


@pytest.fixture(scope="module")
def compiler() -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(c) for c in range(256)], xgr.VocabType.RAW)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def accepts(compiler: Any, grammar: GrammarRef, text: str) -> bool:
    import xgrammar as xgr

    compiled = compile_grammar(compiler, compile_job(grammar.kind, grammar.spec))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text) and matcher.is_terminated())


def test_none_and_no_tools_read_the_output_as_text() -> None:
    assert plan_tools(request(tool_choice="none"), "hermes") == (None, None)
    no_tools = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}]}
    )
    assert plan_tools(no_tools, "") == (None, None)


def test_named_function_is_held_to_its_parameters(compiler: Any) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    calling, grammar = plan_tools(request(tool_choice=choice), "")
    assert calling == ToolCalling("named", function="get_weather")
    assert grammar is not None and json.loads(grammar.spec) == WEATHER
    assert accepts(compiler, grammar, '{"city": "Paris", "unit": "C"}')
    assert not accepts(compiler, grammar, '{"unit": "C"}')  # city is required
    assert not accepts(compiler, grammar, '[{"name": "get_weather"}]')


def test_named_function_without_parameters_takes_an_empty_object(compiler: Any) -> None:
    calling, grammar = plan_tools(
        request(tool_choice={"type": "function", "function": {"name": "ping"}}), ""
    )
    assert calling is not None and grammar is not None
    assert accepts(compiler, grammar, "{}")
    assert not accepts(compiler, grammar, '{"x": 1}')


def test_required_takes_one_or_more_calls_of_the_tools(compiler: Any) -> None:
    calling, grammar = plan_tools(request(tool_choice="required"), "")
    assert calling == ToolCalling("required")
    assert grammar is not None
    spec = json.loads(grammar.spec)
    assert spec["$defs"] == ZONE_DEFS  # moved to the root, where `#/$defs/Zone` points
    good = [
        '[{"name": "get_weather", "parameters": {"city": "Rome"}}]',
        '[{"name": "get_time", "parameters": {"tz": "CET"}}, {"name": "ping", "parameters": {}}]',
    ]
    bad = [
        "[]",
        '[{"name": "get_time", "parameters": {"tz": "PST"}}]',  # not in the $defs enum
        '[{"name": "get_time", "parameters": {"city": "Rome"}}]',  # another tool's parameters
        '[{"name": "launch", "parameters": {}}]',
        'Sure: [{"name": "ping", "parameters": {}}]',
    ]
    assert all(accepts(compiler, grammar, t) for t in good)
    assert not any(accepts(compiler, grammar, t) for t in bad)


def test_required_without_parallel_calls_takes_one_call(compiler: Any) -> None:
    _, grammar = plan_tools(request(tool_choice="required", parallel_tool_calls=False), "")
    assert grammar is not None
    one = '[{"name": "ping", "parameters": {}}]'
    assert accepts(compiler, grammar, one)
    assert not accepts(compiler, grammar, f"[{one[1:-1]}, {one[1:-1]}]")


def test_required_refuses_two_definitions_under_one_defs_name() -> None:
    other = {**ZONE, "$defs": {"Zone": {"enum": ["PST"]}}}
    req = request(tools=[*TOOLS, tool("get_time_2", other)], tool_choice="required")
    with pytest.raises(OpenAIError) as err:
        plan_tools(req, "")
    assert err.value.status == 400 and err.value.param == "tools[3].function.parameters"


def test_auto_reads_the_models_own_calls_with_the_parser() -> None:
    assert plan_tools(request(), "hermes") == (ToolCalling("auto", parser="hermes"), None)
    calling, _ = plan_tools(request(tool_choice="auto", parallel_tool_calls=False), "hermes")
    assert calling == ToolCalling("auto", parallel=False, parser="hermes")
    with pytest.raises(OpenAIError) as err:
        plan_tools(request(), "")
    assert err.value.param == "tool_choice" and "MESHLLM_TOOL_CALL_PARSER" in err.value.message


def test_auto_with_a_strict_tool_holds_each_call_the_model_opens(compiler: Any) -> None:
    tools = [tool("get_weather", WEATHER, strict=True), tool("ping")]
    calling, grammar = plan_tools(request(tools=tools), "hermes")
    assert calling == ToolCalling("auto", parser="hermes")
    assert grammar is not None and grammar.kind == "structural_tag"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(compiler, grammar, "No call needed.")
    assert accepts(compiler, grammar, "Checking.\n" + call)
    assert accepts(
        compiler, grammar, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    )
    assert not accepts(compiler, grammar, call.replace('"city"', '"town"'))
    assert not accepts(compiler, grammar, call.replace("get_weather", "launch"))


def test_llama_strict_calls_take_its_own_format(compiler: Any) -> None:
    tools = [tool("get_weather", WEATHER, strict=True)]
    calling, grammar = plan_tools(request(tools=tools), "llama3_json")
    assert calling == ToolCalling("auto", parser="llama3_json")
    assert grammar is not None and grammar.kind == "structural_tag"
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert accepts(compiler, grammar, call)
    assert accepts(compiler, grammar, "It is sunny.")
    assert not accepts(compiler, grammar, call.replace("Oslo", "x" * 13))  # maxLength 12
