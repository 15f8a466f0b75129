"""Request bodies of the OpenAI API (and vLLM's extra parameters), as pydantic models.

Unknown fields are ignored, as OpenAI does. Every field declared here is honoured somewhere
down the line; a field OpenAI defines but meshllm cannot honour (`suffix`, `best_of > 1`) is
declared only to be refused with a 400 rather than silently dropped.

Checks of one field live here (types, ranges fixed by the API); checks across fields, or that
need the settings or the tokenized prompt, live in `validation.py`, where they can name the
field at fault. Union-typed fields are checked by
"before" validators so an error names the field itself (`stop`, `prompt`) with a plain message
instead of pydantic's per-union-member noise.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from services.gateway.api.body_limits import check_nesting
from services.gateway.api.errors import invalid_request, param_path

#: OpenAI documents up to 4 stop sequences; vLLM has no limit and tools such as lm-eval send
#: more. We accept up to 16: each one costs a hold-back in streaming, so the list stays bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
#: OpenAI's documented logit_bias range.
LOGIT_BIAS_LIMIT = 100.0
#: Seeds are drawn as 63-bit numbers; choice i of n uses seed + i, which stays below 2**64.
MAX_SEED = 2**63
#: The worker keeps sampling parameters in int32/float32 tensors: a larger top_k or penalty
#: would overflow there (and fail the whole step), so it is refused here. A top_k past the
#: vocabulary already means "disabled", and no useful penalty comes near float32's maximum.
MAX_TOP_K = 2**31 - 1
MAX_REPETITION_PENALTY = 3.4028234663852886e38
#: OpenAI's limits on function tools: 128 per request, names of [a-zA-Z0-9_-]{1,64}.
MAX_TOOLS = 128
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
#: vLLM's `bad_words`: each word is banned at the start of text and after a space, so up to
#: two token sequences per word (shared/protocol's MAX_BAD_WORDS bounds the total).
MAX_BAD_WORDS = 128
#: int32 bounds of `priority` (the scheduler compares it as a number).
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
#: apply_chat_template's own arguments: chat_template_kwargs may not set them (the request's
#: fields do), only the template's variables.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
        "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
        "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
    }
)  # fmt: skip
#: OpenAI's max_tokens for /v1/completions when it is omitted or null (chat has none: the rest
#: of the context).
DEFAULT_COMPLETION_MAX_TOKENS = 16


M = TypeVar("M", bound=BaseModel)

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
#: `stop` and `prompt` as the API takes them (a string or a list), for the OpenAPI document;
#: their annotations are the normalised forms the "before" validators produce.
StopStrings = Annotated[
    list[str] | None,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS},
                    "maxItems": MAX_STOP_STRINGS,
                },
                {"type": "null"},
            ]
        }
    ),
]
Prompts = Annotated[
    list[str | list[int]],
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]
        }
    ),
]


def _template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(TEMPLATE_ARGUMENTS.intersection(value or {}))
    if reserved:
        raise ValueError(f"{', '.join(reserved)}: set by the request's own fields, not here")
    return value


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)]
#: OpenAI's reasoning effort levels (chat's `reasoning_effort`, Responses' `reasoning.effort`).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(ApiModel):
    include_usage: bool = False
    # vLLM's: every chunk carries its choice's usage so far (with include_usage).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(ApiModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(ApiModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


class StructuredOutputs(ApiModel):
    """vLLM's `structured_outputs` extra parameter: exactly one constraint kind is set."""

    json_: str | dict[str, Any] | bool | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            name
            for name, value in (
                ("json", self.json_),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "set exactly one of json, json_object, regex, choice, grammar, structural_tag"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self


class SamplingFields(ApiModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    # OpenAI accepts temperatures in [0, 2]; so do we (vLLM takes any value >= 0).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # vLLM: -1 and 0 mean "disabled"
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: StopStrings = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    return_routed_experts: bool = False
    routed_experts_prompt_start: int | None = None
    # vLLM's extra sampling parameters.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = Field(None, ge=0)
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    priority: int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])

    @field_validator("allowed_token_ids", mode="before")
    @classmethod
    def _allowed_ids(cls, value: Any) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not value or not all(_is_token_id(v) for v in value):
            raise ValueError("must be a non-empty list of non-negative integer token ids")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not word.strip() for word in value):
            raise ValueError("a bad word must not be empty or only whitespace")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ValueError("must be a string or a list of strings")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"stop strings must be strings, got {type(item).__name__}")
            if not item:
                raise ValueError("stop strings must not be empty")
            if len(item) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string is longer than {MAX_STOP_STRING_CHARS} chars")
        return list(items)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _token_id_list(cls, value: Any) -> list[int] | None:
        if value is None:
            return None
        if not isinstance(value, list) or not all(_is_token_id(v) for v in value):
            raise ValueError("must be a list of non-negative integer token ids")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases")
        out: dict[int, float] = {}
        for key, bias in value.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"key {key!r} is not a token id") from None
            if token < 0:
                raise ValueError(f"key {key!r} is not a token id")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"bias for {key!r} must be a number")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"bias for {key!r} must be within [-100, 100]")
            out[token] = float(bias)
        return out


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is normalised to a list of prompts, each a string or a
    list of token ids. `max_tokens` omitted or null is OpenAI's default of 16 new tokens
    (DEFAULT_COMPLETION_MAX_TOKENS, applied once the prompt's length is known)."""

    prompt: Prompts
    max_tokens: int | None = Field(
        None, ge=1, description=f"default {DEFAULT_COMPLETION_MAX_TOKENS}, also when null"
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, value: Any) -> list[str | list[int]]:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids, or a list of lists "
                "of token ids, and not empty"
            )
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(type(v) is int for v in value):  # JSON ints (bool is not `int` itself)
            if min(value) < 0:
                raise ValueError("token ids must be non-negative integers")
            return [list(value)]
        if all(isinstance(v, list) for v in value):
            for i, ids in enumerate(value):
                if not ids or not all(_is_token_id(t) for t in ids):
                    raise ValueError(f"prompt {i} must be a non-empty list of token ids")
            return [list(v) for v in value]
        raise ValueError("mixes strings, token ids and lists; use one form")


Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionDefinition(ApiModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (tool_choice.py checks it)
    # A forced call (named, "required") is always held to its schema; under "auto" a strict
    # tool holds every call the model opens (tool_choice.py).
    strict: bool | None = None


class Tool(ApiModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(ApiModel):
    name: str


class NamedToolChoice(ApiModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
TOOL_CHOICES = ("none", "auto", "required")


class CalledFunction(ApiModel):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCall(ApiModel):
    """A call the assistant made earlier in the conversation, sent back with its result."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(ApiModel):
    """One chat turn. A list of content parts is joined with newlines (as vLLM does); only
    text parts exist for a text-only model. `developer` is OpenAI's newer name for `system`.
    An assistant turn may carry the tool calls it made (then its content may be null); a
    `tool` turn carries a call's result and the id of the call it answers."""

    role: Role
    content: str | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of text parts")
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i}: only text parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_assistant(
        cls, value: list[ToolCall] | None, info: ValidationInfo
    ) -> list[ToolCall] | None:
        role = info.data.get("role")
        if value is not None and role is not None and role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {role} messages")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _result_of_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and not value:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if value is not None and role is not None and role != "tool":
            raise ValueError(f"only tool messages carry a tool_call_id, not {role} messages")
        return value


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. Without max_tokens the rest of the context may be used."""

    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    # vLLM's: variables for the chat template (Qwen3's `enable_thinking`, for one).
    chat_template_kwargs: TemplateKwargs = None
    # OpenAI's; as vLLM does, the template gets it as its variable `reasoning_effort` (gpt-oss's
    # reads it; other templates ignore it), unless chat_template_kwargs sets that variable.
    reasoning_effort: ReasoningEffort | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in TOOL_CHOICES:
            return value
        if not isinstance(value, dict):
            raise ValueError(
                'must be "none", "auto", "required" or {"type": "function", "function": '
                '{"name": ...}}'
            )
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = param_path(first.get("loc", ())) or ""
            message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            raise ValueError(f"{where}: {message}" if where else message) from None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name and wins when both are given."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def template_variables(self) -> dict[str, Any] | None:
        """What the chat template gets besides messages and tools."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


class TokenizeRequest(ApiModel):
    """POST /tokenize (vLLM): a text prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # rendered by the template
    chat_template_kwargs: TemplateKwargs = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must contain at least one message")
        return self


class DetokenizeRequest(ApiModel):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _ids(cls, value: Any) -> list[int]:
        if not isinstance(value, list) or not all(_is_token_id(v) for v in value):
            raise ValueError("must be a list of non-negative integer token ids")
        return value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_request(cls: type[M], raw: bytes, *, max_depth: int) -> M:
    """A JSON body as `cls`; any failure is a 400 naming the field (never FastAPI's 422).

    Arrays/objects nested deeper than `max_depth` are refused before parsing (body_limits).
    Strict JSON only: Python's parser also takes NaN and Infinity, which no field can honour,
    and `\\ud800` escapes that decode to lone surrogates, which no tokenizer, msgpack or UTF-8
    response can carry. Both are refused here, so nothing downstream meets them."""
    check_nesting(raw, max_depth)
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
        bad = _lone_surrogate_at(data, ()) if _may_hold_surrogates(raw) else None
    except ValueError as exc:
        raise invalid_request(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # only past an operator's max_depth far above the default
        raise invalid_request("the body is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise invalid_request("the body must be a JSON object")
    if bad is not None:
        param = param_path(bad)
        raise invalid_request(
            f"{param or 'the body'}: a string holds a lone UTF-16 surrogate (not valid Unicode)",
            param,
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_path(first.get("loc", ()))
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise invalid_request(f"{param}: {message}" if param else message, param) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether `raw` can decode to a lone surrogate at all. In UTF-8 (json.loads decodes it
    with surrogatepass) one comes only from a \\uD800-\\uDFFF escape or from the bytes ED A0-BF
    .. that encode a surrogate; a body with neither, nearly every body, skips the walk over
    its values (for a 512-token id prompt the walk cost more than the rest of parsing).
    Bodies in UTF-16 or UTF-32 are always walked."""
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):
        return True
    return b"\xed" in raw or _SURROGATE_ESCAPE.search(raw) is not None


def _lone_surrogate_at(value: Any, loc: tuple[int | str, ...]) -> tuple[int | str, ...] | None:
    """Where the first string (or object key) holding a lone surrogate is, or None."""
    if isinstance(value, str):
        return loc if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _has_surrogate(key):
                return (*loc, key.encode("utf-8", "backslashreplace").decode())
            found = _lone_surrogate_at(item, (*loc, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str | dict | list):  # numbers, booleans, null hold no text
                found = _lone_surrogate_at(item, (*loc, i))
                if found is not None:
                    return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
