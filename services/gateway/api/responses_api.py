"""OpenAI's Responses API (POST /v1/responses) as vLLM serves it without a response store: the
request model, and its translation into the /v1/chat/completions body that serves it.

meshllm keeps no state between requests, so no response is ever stored: `store` is accepted and
reported false (vLLM does the same with its store off), and what needs a stored response or
conversation (`previous_response_id`, `conversation`, `background`, saved `prompt`s) is a 400.
A client carries the conversation itself, sending earlier output items back as input items.

The chat body is planned and run by the chat path as it is, so every rule of the chat endpoint
holds here too, and the chat model validates what both APIs share. A 400 from that path names a
chat field; `responses_error` renames it to the field the client sent. Input items are checked
here, each error naming the item (`input[2].content`): the chat messages they become are
numbered differently.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from services.gateway.api.errors import OpenAIError, invalid_request, param_path
from services.gateway.api.protocol_openai import (
    TOOL_CHOICES,
    ApiModel,
    ReasoningEffort,
    SamplingFields,
)

M = TypeVar("M", bound=ApiModel)

#: OpenAI's bounds on `metadata`: at most 16 pairs, keys up to 64 and values up to 512 chars.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
NO_STORE = "not supported: meshllm keeps no response store; send the conversation as input items"
#: Sampling fields a Responses body may carry as vLLM's extras (top_k, seed, stop, ...), copied
#: into the chat body as they are, so the chat model validates them as it always does: every
#: chat sampling field but those the Responses API has under its own name or sets itself, and
#: those whose output a Response has no place for.
_NOT_PASSED = frozenset(
    {
        "model", "temperature", "top_p", "stream", "user",  # the Responses API's own
        "n", "max_tokens", "stream_options", "response_format",  # renamed, or set here
        "prompt_logprobs", "return_tokens_as_token_ids",  # no place in a Response
        "return_routed_experts", "routed_experts_prompt_start",
    }
)  # fmt: skip
PASSED_THROUGH = frozenset(SamplingFields.model_fields) - _NOT_PASSED
#: A chat 400's `param` -> the Responses field it came from (the first prefix that matches).
#: Messages are numbered apart from input items (instructions, calls joined): all are `input`.
_PARAMS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
)
_TOOL_FUNCTION = re.compile(r"^tools\[(\d+)\]\.function\b")
#: Chat field names in a 400's message that the client knows by their Responses names.
_WORDS = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"))

_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_ITEM_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "type": {"const": "message"},
            "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": _TEXT,
        },
        "required": ["role", "content"],
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "function_call"},
            "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string"},
        },
        "required": ["type", "call_id", "name", "arguments"],
    },
    {
        "type": "object",
        "properties": {
            "type": {"const": "function_call_output"},
            "call_id": {"type": "string"},
            "output": _TEXT,
        },
        "required": ["type", "call_id", "output"],
    },
    {"type": "object", "properties": {"type": {"const": "reasoning"}}, "required": ["type"]},
]
#: `input` as the API takes it, for the OpenAPI document (items are checked by to_chat_body).
ResponseInput = Annotated[
    str | list[dict[str, Any]],
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": _ITEM_SCHEMAS}, "minItems": 1},
            ]
        }
    ),
]


class TextFormat(ApiModel):
    """`text.format`: chat's response_format, flattened (the schema's fields sit beside type)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type 'json_schema' needs a 'schema'")
        return self

    def chat(self) -> dict[str, Any] | None:
        """As chat's response_format (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = self.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(ApiModel):
    format: TextFormat | None = Field(None, json_schema_extra={"default": {"type": "text"}})


class FunctionTool(ApiModel):
    # `type` first: a built-in tool's error is that it is not a function, not its missing name.
    type: str = Field(json_schema_extra={"const": "function"})
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function(cls, value: str) -> str:
        if value != "function":
            raise ValueError(
                f"only function tools are supported, not {value!r}: meshllm runs no built-in "
                "or remote tools"
            )
        return value

    def chat(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": self.model_dump(exclude_none=True, exclude={"type"}),
        }


class ToolChoiceFunction(ApiModel):
    type: Literal["function"]
    name: str


class ReasoningConfig(ApiModel):
    """`effort` is the chat endpoint's reasoning_effort (a template variable). The reasoning
    comes back as its text, so a `summary` kind changes nothing."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(ApiModel):
    """POST /v1/responses. Unknown fields are ignored, but for chat sampling fields (vLLM's
    extras), which are passed on to the chat body (PASSED_THROUGH)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    input: ResponseInput
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    # Ranges are the chat model's (the same names there).
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    # None: "auto" when tools are given, else "none" (as on the chat endpoint).
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool | None = None  # accepted; the response says false
    user: str | None = None
    metadata: dict[str, str] | None = None
    # "message.output_text.logprobs" returns each output token's logprob, with top_logprobs
    # alternatives (0-20, OpenAI's range). The other values ask for data of items meshllm never
    # outputs (searches, images, encrypted reasoning): there is nothing to add.
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    # Declared only to be refused (each needs state meshllm does not keep).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_form(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string or a non-empty list of input items")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise ValueError(f"item {i} must be an object, got {type(item).__name__}")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in TOOL_CHOICES:
            return value
        if not (isinstance(value, dict) and value.get("type") == "function"):
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "name"}')
        if not isinstance(value.get("name"), str):
            raise ValueError("a function tool choice needs the function's name")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs are allowed")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"keys take up to {MAX_METADATA_KEY_CHARS} characters and values up to "
                    f"{MAX_METADATA_VALUE_CHARS} ({key[:MAX_METADATA_KEY_CHARS]!r} is over)"
                )
        return value

    @property
    def output_logprobs(self) -> bool:
        return self.include is not None and "message.output_text.logprobs" in self.include

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError(
                "'auto' is not supported: an input longer than the context is a 400, never trimmed"
            )
        return value

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stored(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(NO_STORE)
        return value

    @field_validator("background")
    @classmethod
    def _background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(f"{NO_STORE} (a background response is fetched from it later)")
        return value

    @field_validator("prompt")
    @classmethod
    def _saved_prompt(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported: meshllm keeps no saved prompts; send instructions")
        return value


# --- input items ------------------------------------------------------------------------------


def _text_parts(value: Any, kinds: tuple[str, ...]) -> Any:
    """Text content (a string, or a list of parts of `kinds`) as chat content (a string, or
    chat's text parts, which the chat model joins as it joins its own)."""
    if isinstance(value, str) or not isinstance(value, list):
        return value  # a string, or a wrong type the field's own check names
    parts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            names = " and ".join(kinds)
            raise ValueError(f"part {i}: only {names} parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}: a text part needs a string 'text'")
        parts.append({"type": "text", "text": part["text"]})
    return parts


class MessageItem(ApiModel):
    """A message; `developer` is the newer name of `system`, as on the chat endpoint."""

    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, str]]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _text_parts(value, ("input_text", "output_text"))


class FunctionCallItem(ApiModel):
    """A call the model made in an earlier response, sent back with its output."""

    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(ApiModel):
    call_id: str
    output: str | list[dict[str, str]]

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, value: Any) -> Any:
        return _text_parts(value, ("input_text",))


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages. A function_call joins the assistant message just before it
    (earlier calls, or the text the model wrote before calling), as the chat endpoint returned
    them: one assistant turn, rendered by the template as the model wrote it. Reasoning items
    are dropped: chat templates do not take earlier turns' reasoning back."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            msg = _validated(MessageItem, item, param)
            out.append({"role": msg.role, "content": msg.content})
        elif kind == "function_call":
            call = _validated(FunctionCallItem, item, param)
            function = {"name": call.name, "arguments": call.arguments}
            tool_call = {"id": call.call_id, "type": "function", "function": function}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(tool_call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            result = _validated(FunctionCallOutputItem, item, param)
            out.append({"role": "tool", "tool_call_id": result.call_id, "content": result.output})
        elif kind != "reasoning":
            raise invalid_request(
                f"{param}.type: {kind!r} items are not supported; input items are messages "
                "(text only), function_call, function_call_output and reasoning",
                f"{param}.type",
            )
    return out


def _validated(cls: type[M], item: dict[str, Any], param: str) -> M:
    try:
        return cls.model_validate(item)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = param_path(first.get("loc", ()))
        full = param if where is None else f"{param}{'' if where[0] == '[' else '.'}{where}"
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise invalid_request(f"{full}: {message}", full) from None


# --- the chat body ----------------------------------------------------------------------------


def to_chat_body(req: ResponsesRequest) -> dict[str, Any]:
    """The /v1/chat/completions body that serves `req`: one choice, always a stream with usage
    last, whose chunks build the Response whether or not the client streams it
    (responses_events.py). 400 for an input item meshllm cannot take."""
    messages = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    messages += input_messages(req.input)
    extras = req.model_extra or {}
    body: dict[str, Any] = {k: v for k, v in extras.items() if k in PASSED_THROUGH}
    body["messages"] = messages
    given = {
        "model": req.model,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "response_format": req.text.format.chat() if req.text and req.text.format else None,
        "tools": [tool.chat() for tool in req.tools] if req.tools is not None else None,
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
    }
    body.update({k: v for k, v in given.items() if v is not None})
    body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.output_logprobs:  # top_logprobs alone returns nothing (OpenAI's and vLLM's rule)
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def _chat_tool_choice(choice: str | ToolChoiceFunction | None) -> Any:
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def responses_error(exc: OpenAIError) -> OpenAIError:
    """A chat path's error as the Responses endpoint reports it: its param, and the chat field
    names in its message, renamed to the fields the client sent."""
    message = exc.message
    for chat, ours in _WORDS:
        message = message.replace(chat, ours)
    return OpenAIError(
        exc.status,
        message,
        type_=exc.type,
        param=responses_param(exc.param),
        code=exc.code,
        headers=exc.headers,
    )


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param == "messages" or param.startswith(("messages[", "messages.")):
        return "input"
    for chat, ours in _PARAMS:
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            return ours + param[len(chat) :]
    return _TOOL_FUNCTION.sub(r"tools[\1]", param)
