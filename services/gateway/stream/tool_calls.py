"""A choice's text -> the tool calls in it, piece by piece as it streams.

One reader per choice, fed the choice's text as the stream assembles it (after stop strings);
`finish` releases what it still holds. Each piece of text yields a `ToolOutput`: content the
client may show now, and parts of calls in OpenAI's streaming form (the first part of a call
carries its id and name, later parts more of its arguments). A non-streamed body feeds the
whole text at once and joins the parts, so both forms say the same.

- named (the output is the arguments, held to their schema by a grammar): every piece is more
  of the one call's arguments.
- required (a JSON array of `{"name", "parameters"}`, held by a grammar): each element becomes
  a call once it is complete.
- hermes (auto): text outside `<tool_call>...</tool_call>` is content, streamed as it comes
  but for a possible start tag at its end; each call is sent once it is closed. A call whose
  JSON does not parse is content, tags included, as vLLM returns it.
- llama3_json (auto): an output that opens with a JSON object is calls, each sent once its
  object closes; any other output is content.
Text a reader cannot read as calls (a required array cut short by max_tokens before any call
was complete) comes back as content, never dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.plan.tool_choice import ToolCalling
from services.gateway.stream.stop_strings import partial_tail

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class CallPart:
    """A piece of one call: `id` and `name` on its first part only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def delta(self) -> dict[str, Any]:
        """The part as an element of a stream chunk's `delta.tool_calls`."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ToolOutput:
    content: str = ""
    parts: list[CallPart] = field(default_factory=list)

    def then(self, later: ToolOutput) -> ToolOutput:
        return ToolOutput(self.content + later.content, self.parts + later.parts)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """The interface: text in, content and call parts out; `called` once a call was sent."""

    def __init__(self) -> None:
        self.num_calls = 0

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> ToolOutput:
        raise NotImplementedError

    def finish(self) -> ToolOutput:
        return ToolOutput()

    def _call(self, name: str, arguments: Any) -> CallPart:
        """A whole call as one part (the next index, a new id)."""
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        part = CallPart(self.num_calls, arguments, id=new_call_id(), name=name)
        self.num_calls += 1
        return part


class NamedCallReader(ToolCallReader):
    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def feed(self, text: str) -> ToolOutput:
        if not text:
            return ToolOutput()
        if not self.called:
            return ToolOutput(parts=[self._call(self.function, text)])
        return ToolOutput(parts=[CallPart(0, text)])

    def finish(self) -> ToolOutput:
        # A call with empty arguments still exists (the output was cut before its first byte).
        return ToolOutput() if self.called else ToolOutput(parts=[self._call(self.function, "")])


class JsonCallsReader(ToolCallReader):
    """Calls written as a run of JSON objects `{"name": ..., <arguments>: {...}}` between
    separator characters; each call is sent once its object closes. Text from the first thing
    that is not such an object on is `rest` (content, unless calls were read before it and it is
    only the run's closing)."""

    SEPARATORS = " \t\r\n"
    ARGUMENT_KEYS: tuple[str, ...] = ("parameters",)

    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.parallel = parallel
        self._buffer = ""
        self._pos = 0  # where the next object (or separator) starts in the buffer
        self._failed = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ToolOutput:
        self._buffer += text
        out = ToolOutput()
        while not self._failed:
            start = self._pos
            while start < len(self._buffer) and self._buffer[start] in self.SEPARATORS:
                start += 1
            if start >= len(self._buffer):
                break
            try:
                element, end = self._decoder.raw_decode(self._buffer, start)
            except ValueError:
                if self._buffer[start] != "{":
                    self._failed = True  # not an object: the calls are over
                break  # an object not complete yet
            if not (isinstance(element, dict) and isinstance(element.get("name"), str)):
                self._failed = True
                break
            arguments = next((element[k] for k in self.ARGUMENT_KEYS if k in element), {})
            if self.parallel or not self.called:
                out.parts.append(self._call(element["name"], arguments))
            self._pos = end
        return out

    def finish(self) -> ToolOutput:
        return ToolOutput(content=self.rest())

    def rest(self) -> str:
        """What finish returns as content: the whole text when no call was read, else what
        follows the calls (the run's closing excepted)."""
        if not self.called:
            return self._buffer
        rest = self._buffer[self._pos :].lstrip(self.SEPARATORS)
        return "" if not rest.strip(self.SEPARATORS + "]") else rest


class RequiredCallsReader(JsonCallsReader):
    """Reads `[{"name": ..., "parameters": {...}}, ...]` (the "required" grammar's array) one
    complete element at a time."""

    SEPARATORS = " \t\r\n[,"


class Llama3JsonCallsReader(JsonCallsReader):
    """Llama 3.1/3.2's JSON calls (vLLM's `llama3_json`): an output that opens with `{` (after
    the `<|python_tag|>` marker, when the detokenizer keeps it) is calls, `{"name": ...,
    "parameters": {...}}` objects separated by `;`; any other output is content, streamed as it
    comes."""

    SEPARATORS = " \t\r\n;"
    ARGUMENT_KEYS = ("parameters", "arguments")

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._mode: str | None = None  # "content" or "calls" once the output's start tells
        self._head = ""  # the output until then

    def feed(self, text: str) -> ToolOutput:
        if self._mode == "content":
            return ToolOutput(content=text)
        if self._mode == "calls":
            return super().feed(text)
        self._head += text
        opening = self._head.lstrip()
        if opening.startswith(PYTHON_TAG):
            opening = opening[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(opening):
            return ToolOutput()  # nothing yet, or the start of the marker
        if not opening:
            return ToolOutput()
        if opening[0] != "{":
            self._mode = "content"
            return ToolOutput(content=self._head)
        self._mode = "calls"
        return super().feed(opening)

    def finish(self) -> ToolOutput:
        if self._mode is None:  # the output ended before it told: it is content
            return ToolOutput(content=self._head)
        if self._mode == "calls" and not self.called:
            return ToolOutput(content=self._head)  # no call parsed: the text as written
        return super().finish() if self._mode == "calls" else ToolOutput()


class HermesCallsReader(ToolCallReader):
    def __init__(self, parallel: bool = True) -> None:
        super().__init__()
        self.parallel = parallel
        self._held = ""  # content that may be the start of a call tag
        self._call_text: str | None = None  # inside a call: its text so far
        self._spacing = ""  # whitespace after a call, held (see _content)

    def feed(self, text: str) -> ToolOutput:
        out = ToolOutput()
        text = self._held + text
        self._held = ""
        while text:
            if self._call_text is None:
                start = text.find(CALL_START)
                if start < 0:
                    keep = partial_tail(text, CALL_START)
                    out.content += self._content(text[: len(text) - keep])
                    self._held = text[len(text) - keep :]
                    break
                out.content += self._content(text[:start])
                self._call_text = ""
                text = text[start + len(CALL_START) :]
            else:
                joined = self._call_text + text
                end = joined.find(CALL_END)
                if end < 0:
                    self._call_text = joined
                    break
                out = out.then(self._close(joined[:end]))
                text = joined[end + len(CALL_END) :]
        return out

    def finish(self) -> ToolOutput:
        held, self._held = self._held, ""
        if self._call_text is None:
            return ToolOutput(content=self._content(held))
        # A call still open when the output ended (its end tag cut off): read what there is.
        return self._close(self._call_text, closed=False)

    def _close(self, body: str, closed: bool = True) -> ToolOutput:
        self._call_text = None
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            raw = CALL_START + body + (CALL_END if closed else "")
            return ToolOutput(content=self._content(raw))
        if self.called and not self.parallel:
            return ToolOutput()  # parallel_tool_calls false: the first call only
        return ToolOutput(parts=[self._call(call["name"], call.get("arguments", {}))])

    def _content(self, text: str) -> str:
        """Content, but for whitespace after a call: the format puts newlines between and
        after calls, so whitespace there waits until words follow it (then it is theirs) or
        the output ends (then it is dropped)."""
        if not self.called:
            return text
        self._spacing += text
        if not self._spacing.strip():
            return ""
        text, self._spacing = self._spacing, ""
        return text


def tool_call_reader(calling: ToolCalling) -> ToolCallReader:
    if calling.mode == "named":
        assert calling.function is not None
        return NamedCallReader(calling.function)
    if calling.mode == "required":
        return RequiredCallsReader()
    if calling.parser == "hermes":
        return HermesCallsReader(calling.parallel)
    if calling.parser == "llama3_json":
        return Llama3JsonCallsReader(calling.parallel)
    raise ValueError(f"no tool-call parser {calling.parser!r}")


def joined_calls(parts: list[CallPart]) -> list[dict[str, Any]]:
    """Stream parts as a body's `message.tool_calls`."""
    calls: list[dict[str, Any]] = []
    for part in parts:
        if part.id is not None:
            function = {"name": part.name, "arguments": part.arguments}
            calls.append({"id": part.id, "type": "function", "function": function})
        else:
            calls[part.index]["function"]["arguments"] += part.arguments
    return calls


def tool_finish_reason(calling: ToolCalling, reader: ToolCallReader, engine_reason: str) -> str:
    """OpenAI's reasons: "tool_calls" when the model chose to call (auto, required) and ended
    on its own; a forced named call ends with "stop"; a cut-off output keeps "length"."""
    if calling.mode != "named" and reader.called and engine_reason == "stop":
        return "tool_calls"
    return engine_reason
