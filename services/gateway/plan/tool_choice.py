"""`tools` and `tool_choice` -> how a chat request's output becomes tool calls.

The four choices, as OpenAI defines them and vLLM serves them:
- "none": the template is shown the tools; the output stays text.
- a named function: a JSON-schema grammar (the structured-output path) holds the output to that
  function's parameters, and the output is the call's arguments. Works with every model.
- "required": the grammar holds the output to a JSON array of one or more `{"name",
  "parameters"}` objects, one per call (vLLM's schema); `parallel_tool_calls: false` caps it at
  one call.
- "auto", the default when tools are given: the model decides, and a parser for the model's own
  call format finds the calls in its text (MESHLLM_TOOL_CALL_PARSER; `hermes`:
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the format of Qwen2.5/Qwen3 and
  Hermes; `llama3_json`: `{"name": ..., "parameters": ...}` objects separated by `;`, Llama
  3.1/3.2's JSON calls). Without a parser "auto" is a 400, as in vLLM: the calls would reach
  the client as text it cannot tell from an answer. With a `strict` tool, a structural tag
  holds every call the model opens to a tool's schema, and the text around the calls stays
  free.
The output side (text -> calls) is services/gateway/stream/tool_calls.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from services.gateway.api.errors import invalid_request
from services.gateway.api.protocol_openai import ChatCompletionRequest, NamedToolChoice, Tool
from services.gateway.plan.structured_outputs import check_schema
from shared.protocol import GrammarRef

ToolCallParserName = Literal["", "hermes", "llama3_json"]
#: Each parser's call format as (start of a call before its name, between the name and the
#: arguments, end of a call, the text that opens a call), for the structural tag of strict tools.
CALL_FORMATS: dict[str, tuple[str, str, str, str]] = {
    "hermes": ('<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>", "<tool_call>"),
    "llama3_json": ('{"name": ', ', "parameters": ', "}", '{"name": '),
}
#: The arguments of a function declared without parameters: an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalling:
    """How a request's output is read as tool calls (the plan carries it to the stream)."""

    mode: Literal["named", "required", "auto"]
    function: str | None = None  # named: the function the output calls
    parallel: bool = True  # auto: keep every call the model makes, or only its first
    parser: ToolCallParserName = ""  # auto: the model's call format


def plan_tools(
    req: ChatCompletionRequest, parser: ToolCallParserName
) -> tuple[ToolCalling | None, GrammarRef | None]:
    """The tool calling a chat request asks for, and the grammar that forces its calls (named
    and "required"); (None, None) when its output is plain text. Every misuse is a 400."""
    tools = req.tools or []
    _check_tools(tools)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None, None
    if not tools:
        raise invalid_request(f"tool_choice {_describe(choice)} needs tools", "tool_choice")
    if choice == "auto":
        if not parser:
            raise invalid_request(
                'tool_choice "auto" (the default when tools are given) needs a parser for the '
                "model's tool-call format: start the gateway with MESHLLM_TOOL_CALL_PARSER "
                '(e.g. hermes), or send tool_choice "required", "none" or a named function',
                "tool_choice",
            )
        calling = ToolCalling("auto", parallel=req.parallel_tool_calls, parser=parser)
        if not any(t.function.strict for t in tools):
            return calling, None
        _check_no_other_constraint(req, 'tool_choice "auto" with a strict tool')
        return calling, _calls_tag(tools, parser)
    _check_no_other_constraint(req, f"tool_choice {_describe(choice)}")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise invalid_request(
                f"tool_choice names function {name!r}, which is not among the tools",
                "tool_choice.function.name",
            )
        schema = tool.function.parameters or NO_PARAMETERS
        return ToolCalling("named", function=name), _json_schema(schema)
    return ToolCalling("required"), _json_schema(_calls_schema(tools, req.parallel_tool_calls))


def _check_no_other_constraint(req: ChatCompletionRequest, what: str) -> None:
    constrained = req.response_format is not None and req.response_format.type != "text"
    if constrained or req.structured_outputs is not None:
        raise invalid_request(
            f"{what} holds the output to the tools' schemas; it cannot be combined with "
            "response_format or structured_outputs",
            "tool_choice",
        )


def _calls_tag(tools: list[Tool], parser: ToolCallParserName) -> GrammarRef:
    """`strict` tools under "auto": the text stays free, but once the model opens a call a
    structural tag holds it to one tool's name and parameters, in the exact form the parser
    reads. Every tool gets a structure (a non-strict one its own schema too): with only some,
    the trigger would bar the model from calling the others."""
    start, between, end, trigger = CALL_FORMATS[parser]
    structures = [
        {
            "begin": f"{start}{json.dumps(t.function.name)}{between}",
            "schema": t.function.parameters or NO_PARAMETERS,
            "end": end,
        }
        for t in tools
    ]
    tag = {"structures": structures, "triggers": [trigger]}
    return GrammarRef(kind="structural_tag", spec=json.dumps(tag, ensure_ascii=False))


def _check_tools(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise invalid_request(
                f"function {name!r} is declared twice", f"tools[{i}].function.name"
            )
        seen.add(name)
        if tool.function.parameters is not None:
            check_schema(tool.function.parameters, f"tools[{i}].function.parameters")


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for "required": an array of calls, each one tool's name and parameters.
    Each tool's `$defs` move to the root, where the `#/$defs/...` references of its parameters
    point once the parameters are nested in the array."""
    branches, defs = [], {}
    for i, tool in enumerate(tools):
        params = dict(tool.function.parameters or NO_PARAMETERS)
        for name, definition in params.pop("$defs", {}).items():
            if name in defs and defs[name] != definition:
                raise invalid_request(
                    f"$defs entry {name!r} differs between tools; a required tool choice needs "
                    "one definition per name",
                    f"tools[{i}].function.parameters",
                )
            defs[name] = definition
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _json_schema(schema: dict[str, Any]) -> GrammarRef:
    return GrammarRef(kind="json_schema", spec=json.dumps(schema, ensure_ascii=False))


def _describe(choice: str | NamedToolChoice) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"naming function {choice.function.name!r}"
    return f'"{choice}"'
