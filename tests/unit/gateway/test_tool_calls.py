"""Reading a choice's text as tool calls (services/gateway/stream/tool_calls.py): whatever
pieces the text streams in, the calls and the content are those of the whole text, each call
is sent as soon as it is complete, and nothing the model wrote is dropped."""

from __future__ import annotations

import json

import pytest

from services.gateway.plan.tool_choice import ToolCalling
from services.gateway.stream.tool_calls import (
    CALL_START,
    PYTHON_TAG,
    HermesCallsReader,
    Llama3JsonCallsReader,
    NamedCallReader,
    RequiredCallsReader,
    ToolCallReader,
    ToolOutput,
    joined_calls,
    tool_call_reader,
    tool_finish_reason,
)


def read(reader: ToolCallReader, pieces: list[str]) -> tuple[str, list[dict], list[ToolOutput]]:
    """Content, joined calls, and the output of each piece (the last one with finish)."""
    outputs = [reader.feed(p) for p in pieces]
    outputs.append(reader.finish())
    content = "".join(o.content for o in outputs)
    parts = [part for o in outputs for part in o.parts]
    return content, joined_calls(parts), outputs


def calls_of(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def splits(text: str) -> list[list[str]]:
    """The text whole, char by char, and cut in two at every position."""
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


# --- named -----------------------------------------------------------------------------------


def test_named_call_streams_its_arguments_as_they_come() -> None:
    reader = NamedCallReader("get_weather")
    first = reader.feed('{"city": ')
    second = reader.feed('"Paris"}')
    assert [p.delta() for p in first.parts] == [
        {
            "index": 0,
            "id": first.parts[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": '},
        }
    ]
    assert first.parts[0].id and first.parts[0].id.startswith("call_")
    assert [p.delta() for p in second.parts] == [
        {"index": 0, "function": {"arguments": '"Paris"}'}}
    ]
    assert reader.finish().parts == []
    assert first.content == second.content == ""


def test_named_call_with_no_output_still_exists() -> None:
    content, calls, _ = read(NamedCallReader("ping"), [])
    assert content == "" and calls_of(calls) == [("ping", "")]


# --- required --------------------------------------------------------------------------------

CALLS_TEXT = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
)
CALLS = [("get_weather", '{"city": "Paris"}'), ("now", "{}")]


@pytest.mark.parametrize("pieces", splits(CALLS_TEXT))
def test_required_calls_are_the_same_however_the_text_is_cut(pieces: list[str]) -> None:
    content, calls, _ = read(RequiredCallsReader(), pieces)
    assert content == ""
    assert calls_of(calls) == CALLS
    assert len({c["id"] for c in calls}) == 2


def test_each_required_call_is_sent_when_its_object_closes() -> None:
    end_of_first = CALLS_TEXT.index("}}") + 2
    _, _, outputs = read(RequiredCallsReader(), list(CALLS_TEXT))
    sent_at = [i for i, o in enumerate(outputs) for _ in o.parts]
    assert sent_at == [end_of_first - 1, len(CALLS_TEXT) - 2]  # at the `}` closing each call


def test_required_output_cut_before_a_whole_call_is_content() -> None:
    cut = CALLS_TEXT[:30]
    content, calls, _ = read(RequiredCallsReader(), [cut])
    assert calls == [] and content == cut


def test_required_output_cut_after_a_whole_call_keeps_it_and_what_follows() -> None:
    cut = CALLS_TEXT[: CALLS_TEXT.index("}}") + 10]
    content, calls, _ = read(RequiredCallsReader(), [cut])
    assert calls_of(calls) == CALLS[:1] and content == '{"name'  # the call max_tokens cut


def test_parameters_keep_non_ascii_text() -> None:
    text = '[{"name": "say", "parameters": {"text": "déjà vu"}}]'
    _, calls, _ = read(RequiredCallsReader(), [text])
    assert json.loads(calls[0]["function"]["arguments"]) == {"text": "déjà vu"}
    assert "déjà" in calls[0]["function"]["arguments"]


# --- hermes (auto) ---------------------------------------------------------------------------

HERMES_TEXT = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize("pieces", splits(HERMES_TEXT))
def test_hermes_calls_and_content_are_the_same_however_the_text_is_cut(
    pieces: list[str],
) -> None:
    content, calls, outputs = read(HermesCallsReader(), pieces)
    assert content == "Let me check.\n"
    assert calls_of(calls) == CALLS
    # No piece of a tag ever reaches the client as content.
    assert all("<" not in o.content for o in outputs)


def test_hermes_content_streams_before_the_call_is_closed() -> None:
    reader = HermesCallsReader()
    assert reader.feed("Let me ").content == "Let me "
    assert reader.feed("check.\n<tool").content == "check.\n"  # the tag's start is held
    assert reader.feed('_call>\n{"name": "now", "arguments"').parts == []
    out = reader.feed(": {}}\n</tool_call>")
    assert calls_of(joined_calls(out.parts)) == [("now", "{}")]


def test_hermes_text_without_calls_is_all_content() -> None:
    text = "a < b, and <tool is not a tag; <tool_"
    for pieces in splits(text):
        reader = HermesCallsReader()
        content, calls, _ = read(reader, pieces)
        assert (content, calls, reader.called) == (text, [], False)


def test_hermes_call_that_does_not_parse_is_content_tags_and_all() -> None:
    text = 'Here: <tool_call>\n{"name": "now", "arguments": \n</tool_call> done'
    content, calls, _ = read(HermesCallsReader(), [text])
    assert calls == [] and content == text


def test_hermes_call_left_open_at_the_end_is_read() -> None:
    text = '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n'
    content, calls, _ = read(HermesCallsReader(), list(text))
    assert calls_of(calls) == [("now", '{"tz": "UTC"}')] and content == ""
    broken = CALL_START + '{"name": "now"'
    content, calls, _ = read(HermesCallsReader(), [broken])
    assert calls == [] and content == broken


def test_hermes_arguments_sent_as_a_string_are_kept_as_sent() -> None:
    text = '<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    _, calls, _ = read(HermesCallsReader(), [text])
    assert calls_of(calls) == [("now", '{"tz": "UTC"}')]


def test_hermes_words_after_the_calls_are_content_but_whitespace_is_not() -> None:
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n\nDone.'
    content, calls, _ = read(HermesCallsReader(), list(text))
    assert calls_of(calls) == [("now", "{}")] and content == "\n\nDone."
    content, _, _ = read(HermesCallsReader(), [text.removesuffix("Done.")])
    assert content == ""


def test_without_parallel_calls_only_the_first_call_is_kept() -> None:
    content, calls, _ = read(HermesCallsReader(parallel=False), [HERMES_TEXT])
    assert calls_of(calls) == CALLS[:1] and content == "Let me check.\n"


# --- llama3_json (auto) ----------------------------------------------------------------------

LLAMA_TEXT = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "arguments": {}}'
)


@pytest.mark.parametrize("pieces", splits(LLAMA_TEXT) + splits(PYTHON_TAG + LLAMA_TEXT))
def test_llama_calls_are_the_same_however_the_text_is_cut(pieces: list[str]) -> None:
    content, calls, outputs = read(Llama3JsonCallsReader(), pieces)
    assert content == "" and calls_of(calls) == CALLS
    sent_at = [i for i, o in enumerate(outputs) for _ in o.parts]
    if len(pieces) > 2:  # char by char: each call as its object closes
        offset = len(PYTHON_TAG) if pieces[0] == "<" else 0
        assert sent_at == [offset + LLAMA_TEXT.index("}}") + 1, len(pieces) - 1]


@pytest.mark.parametrize("text", ["The weather is fine.", "  <|python", "<b>bold</b> text", ""])
def test_llama_output_that_does_not_open_with_an_object_is_content(text: str) -> None:
    for pieces in splits(text) if text else [[]]:
        reader = Llama3JsonCallsReader()
        content, calls, _ = read(reader, pieces)
        assert (content, calls, reader.called) == (text, [], False)


def test_llama_content_streams_as_it_comes() -> None:
    reader = Llama3JsonCallsReader()
    assert reader.feed("Sun").content == "Sun"  # told at the first character
    assert reader.feed("ny.").content == "ny."


def test_llama_object_that_is_not_a_call_is_the_text_as_written() -> None:
    for text in ['{"city": "Paris"}', '{"name": "now", "parameters": {}', "{not json"]:
        content, calls, _ = read(Llama3JsonCallsReader(), [text])
        assert (content, calls) == (text, [])


def test_llama_words_after_the_calls_are_content() -> None:
    text = '{"name": "now", "parameters": {}}; Done.'
    content, calls, _ = read(Llama3JsonCallsReader(), list(text))
    assert calls_of(calls) == [("now", "{}")] and content == "Done."
    content, calls, _ = read(Llama3JsonCallsReader(parallel=False), [LLAMA_TEXT])
    assert calls_of(calls) == CALLS[:1] and content == ""


# --- choice of reader and finish reason ------------------------------------------------------


def test_reader_and_finish_reason_follow_the_tool_choice() -> None:
    named = ToolCalling("named", function="now")
    required = ToolCalling("required")
    auto = ToolCalling("auto", parser="hermes")
    assert isinstance(tool_call_reader(named), NamedCallReader)
    assert isinstance(tool_call_reader(required), RequiredCallsReader)
    assert isinstance(tool_call_reader(auto), HermesCallsReader)
    llama = ToolCalling("auto", parser="llama3_json")
    assert isinstance(tool_call_reader(llama), Llama3JsonCallsReader)

    called = tool_call_reader(auto)
    called.feed('<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    silent = tool_call_reader(auto)
    silent.feed("No call needed.")
    assert tool_finish_reason(auto, called, "stop") == "tool_calls"
    assert tool_finish_reason(auto, called, "length") == "length"  # cut off: says so
    assert tool_finish_reason(auto, silent, "stop") == "stop"
    forced = tool_call_reader(named)
    forced.feed("{}")
    assert tool_finish_reason(named, forced, "stop") == "stop"  # OpenAI's for a forced call
