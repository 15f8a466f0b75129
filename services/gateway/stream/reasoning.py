"""A reasoning model's text -> its reasoning and its answer, piece by piece as it streams.

vLLM's `--reasoning-parser` (MESHLLM_REASONING_PARSER): the thinking a model writes between
`<think>` and `</think>` is returned apart from the answer, as `reasoning_content` (a body's
message, a stream's delta), and only the answer is content (and read for tool calls).
- deepseek_r1: the template opens the thinking in the prompt, so the output is reasoning from
  its start (an opening `<think>` it writes anyway is dropped) until `</think>`; an output that
  never closes it is all reasoning.
- qwen3: reasoning only when the output opens with `<think>`; otherwise (`enable_thinking`
  off, whose template closes an empty block in the prompt) all of it is content.
A tag split across pieces is held back until the next piece says what it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.gateway.stream.stop_strings import partial_tail

ReasoningParserName = Literal["", "deepseek_r1", "qwen3"]
THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningReader:
    def __init__(self, parser: ReasoningParserName) -> None:
        if not parser:
            raise ValueError("no reasoning parser")
        self.parser = parser
        self._state: Literal["start", "reasoning", "content"] = "start"
        self._held = ""
        self._fed = 0  # chars fed
        self._content = 0  # chars returned as content

    @property
    def reasoning_chars(self) -> int:
        """How much of the text fed so far was reasoning: its tags included, what is held
        back not (after finish, nothing is)."""
        return self._fed - self._content - len(self._held)

    def feed(self, text: str) -> Split:
        self._fed += len(text)
        out = self._feed(text)
        self._content += len(out.content)
        return out

    def _feed(self, text: str) -> Split:
        text, self._held = self._held + text, ""
        out = Split()
        if self._state == "start":
            opening = text.lstrip()
            if THINK_START.startswith(opening) and opening != THINK_START:
                self._held = text  # nothing yet, or the start of the tag
                return out
            if opening.startswith(THINK_START):
                text = opening[len(THINK_START) :]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = partial_tail(text, THINK_END)
                out.reasoning = text[: len(text) - keep]
                self._held = text[len(text) - keep :]
                return out
            out.reasoning = text[:end]
            text = text[end + len(THINK_END) :]
            self._state = "content"
        out.content = text
        return out

    def finish(self) -> Split:
        """What is still held: a tag's start that the output ended in is text after all."""
        held, self._held = self._held, ""
        if self._state == "reasoning" or (self._state == "start" and self.parser == "deepseek_r1"):
            return Split(reasoning=held)
        self._content += len(held)
        return Split(content=held)
