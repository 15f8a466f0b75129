"""A chat choice's text -> the parts of the assistant's message: reasoning, content, tool calls.

The reasoning reader (when the gateway has a reasoning parser) takes the text first; what it
passes on as the answer goes to the tool-call reader (when tools are in play), whose content is
the message's content. One reader per choice serves a stream piece by piece and a body at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.plan.tool_choice import ToolCalling
from services.gateway.stream.reasoning import ReasoningParserName, ReasoningReader, Split
from services.gateway.stream.tool_calls import (
    CallPart,
    ToolCallReader,
    ToolOutput,
    tool_call_reader,
    tool_finish_reason,
)


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    parts: list[CallPart] = field(default_factory=list)

    def then(self, later: MessageDelta) -> MessageDelta:
        return MessageDelta(
            self.reasoning + later.reasoning, self.content + later.content, self.parts + later.parts
        )

    def __bool__(self) -> bool:
        """Whether it says anything (text held back by a reader says nothing yet)."""
        return bool(self.reasoning or self.content or self.parts)

    def delta(self) -> dict[str, Any]:
        """As a stream chunk's `delta` (vLLM's field for the reasoning)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.parts:
            out["tool_calls"] = [part.delta() for part in self.parts]
        return out


class MessageReader:
    def __init__(self, tools: ToolCalling | None, reasoning: ReasoningParserName) -> None:
        self.calling = tools
        self._reasoning = ReasoningReader(reasoning) if reasoning else None
        self._tools: ToolCallReader | None = tool_call_reader(tools) if tools else None

    @property
    def reasoning_chars(self) -> int:
        """How much of the text was reasoning (ReasoningReader.reasoning_chars); 0 without a
        reasoning parser."""
        return self._reasoning.reasoning_chars if self._reasoning else 0

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def feed(self, text: str) -> MessageDelta:
        split = self._reasoning.feed(text) if self._reasoning else Split(content=text)
        return self._answer(split, self._tools.feed(split.content) if self._tools else None)

    def finish(self) -> MessageDelta:
        split = self._reasoning.finish() if self._reasoning else Split()
        if self._tools is None:
            return self._answer(split, None)
        output = self._tools.feed(split.content).then(self._tools.finish())
        return self._answer(split, output)

    def finish_reason(self, engine_reason: str) -> str:
        if self.calling is None or self._tools is None:
            return engine_reason
        return tool_finish_reason(self.calling, self._tools, engine_reason)

    @staticmethod
    def _answer(split: Split, tools: ToolOutput | None) -> MessageDelta:
        if tools is None:
            return MessageDelta(split.reasoning, split.content)
        return MessageDelta(split.reasoning, tools.content, tools.parts)


def message_reader(
    tools: ToolCalling | None, reasoning: ReasoningParserName
) -> MessageReader | None:
    """None when the text is the content as it is (no reasoning parser, no tools in play)."""
    if tools is None and not reasoning:
        return None
    return MessageReader(tools, reasoning)
