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
Text a reader cannot read as calls (a required array cut short by max_tokens before any call
was complete) comes back as content, never dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.plan.tool_choice import ToolCalling

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


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


class RequiredCallsReader(ToolCallReader):
    """Reads `[{"name": ..., "parameters": {...}}, ...]` one complete element at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._pos = 0  # where the next element (or separator) starts in the buffer
        self._failed = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ToolOutput:
        self._buffer += text
        out = ToolOutput()
        while not self._failed:
            start = self._skip(self._pos)
            if start >= len(self._buffer) or self._buffer[start] == "]":
                break
            try:
                element, end = self._decoder.raw_decode(self._buffer, start)
            except ValueError:
                break  # not complete yet
            if not (isinstance(element, dict) and isinstance(element.get("name"), str)):
                self._failed = True
                break
            out.parts.append(self._call(element["name"], element.get("parameters", {})))
            self._pos = end
        return out

    def finish(self) -> ToolOutput:
        if self.called:
            return ToolOutput()
        return ToolOutput(content=self._buffer)

    def _skip(self, pos: int) -> int:
        """Past whitespace, the array's `[` and the commas between elements."""
        while pos < len(self._buffer) and self._buffer[pos] in " \t\r\n[,":
            pos += 1
        return pos


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
                    keep = _partial_tag_at_end(text, CALL_START)
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


def _partial_tag_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def tool_call_reader(calling: ToolCalling) -> ToolCallReader:
    if calling.mode == "named":
        assert calling.function is not None
        return NamedCallReader(calling.function)
    if calling.mode == "required":
        return RequiredCallsReader()
    if calling.parser == "hermes":
        return HermesCallsReader(calling.parallel)
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
