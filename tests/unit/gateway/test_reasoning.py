"""Splitting a reasoning model's thinking from its answer (services/gateway/stream/reasoning.py
and message_reader.py): the same split however the text is cut, no piece of a tag in either
part, and the answer (only) read for tool calls."""

from __future__ import annotations

import pytest

from services.gateway.plan.tool_choice import ToolCalling
from services.gateway.stream.message_reader import MessageDelta, message_reader
from services.gateway.stream.reasoning import ReasoningParserName, ReasoningReader, Split
from services.gateway.stream.tool_calls import joined_calls


def split(parser: ReasoningParserName, pieces: list[str]) -> tuple[str, str, list[Split]]:
    """The reasoning and the content read from `pieces`; the reader's reasoning_chars is
    checked against them: the text but the content, tags included."""
    reader = ReasoningReader(parser)
    outputs = [reader.feed(p) for p in pieces]
    outputs.append(reader.finish())
    reasoning = "".join(o.reasoning for o in outputs)
    content = "".join(o.content for o in outputs)
    text = "".join(pieces)
    assert text.endswith(content)
    assert reader.reasoning_chars == len(text) - len(content)
    return reasoning, content, outputs


def cuts(text: str) -> list[list[str]]:
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


THOUGHT = "Paris is the capital. Say so."
ANSWER = "\n\nIt is Paris."


@pytest.mark.parametrize("pieces", cuts(f"<think>{THOUGHT}</think>{ANSWER}"))
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_thinking_and_answer_however_the_text_is_cut(
    parser: ReasoningParserName, pieces: list[str]
) -> None:
    reasoning, content, outputs = split(parser, pieces)
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert not any("<" in o.reasoning or "</" in o.content for o in outputs)


@pytest.mark.parametrize("pieces", cuts(f"{THOUGHT}</think>{ANSWER}"))
def test_deepseek_thinks_from_the_start_of_its_output(pieces: list[str]) -> None:
    assert split("deepseek_r1", pieces)[:2] == (THOUGHT, ANSWER)


def test_deepseek_output_that_never_closes_its_thinking_is_all_reasoning() -> None:
    for pieces in cuts("Still thinking about </thi"):
        assert split("deepseek_r1", pieces)[:2] == ("Still thinking about </thi", "")


@pytest.mark.parametrize("text", ["It is Paris.", "  <b>Paris</b>", "<thin", ""])
def test_qwen3_output_without_a_thinking_block_is_all_content(text: str) -> None:
    for pieces in cuts(text) if text else [[]]:
        assert split("qwen3", pieces)[:2] == ("", text)


def test_reasoning_streams_before_its_end_tag_comes() -> None:
    reader = ReasoningReader("qwen3")
    assert reader.feed("<think>Hm").reasoning == "Hm"
    assert reader.reasoning_chars == len("<think>Hm")
    assert reader.feed("m, </th") == Split(reasoning="m, ")  # the tag's start is held
    assert reader.reasoning_chars == len("<think>Hmm, ")  # not yet counted either
    assert reader.feed("ink>Paris") == Split(content="Paris")
    assert reader.reasoning_chars == len("<think>Hmm, </think>")


def test_the_answer_after_thinking_is_read_for_tool_calls() -> None:
    text = (
        "<think>The user wants weather.</think>\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for pieces in cuts(text):
        reader = message_reader(ToolCalling("auto", parser="hermes"), "qwen3")
        assert reader is not None
        out = MessageDelta()
        for piece in pieces:
            out = out.then(reader.feed(piece))
        out = out.then(reader.finish())
        assert out.reasoning == "The user wants weather."
        assert out.content == "\n"
        assert [c["function"]["name"] for c in joined_calls(out.parts)] == ["get_weather"]
        assert reader.finish_reason("stop") == "tool_calls"


def test_no_reader_without_reasoning_or_tools() -> None:
    assert message_reader(None, "") is None
    reader = message_reader(None, "deepseek_r1")
    assert reader is not None and reader.finish_reason("length") == "length"
