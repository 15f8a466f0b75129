"""Stop strings match across chunk boundaries and never reach the output."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.stream.stop_strings import StopStringMatcher


def run(stops: list[str], chunks: list[str], include: bool = False) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops, include=include)
    out = ""
    for chunk in chunks:
        check = matcher.feed(chunk)
        out += check.text
        if check.stopped:
            return out, True
    return out + matcher.flush(), False


def expected(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    """Generation stops at the first chunk (token) after which the text so far contains a stop
    string; the output ends before the earliest one found then. (A stop that would start
    earlier but complete later is never generated: the request already stopped.)"""
    text = ""
    for chunk in chunks:
        text += chunk
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


def test_stop_split_over_every_boundary() -> None:
    text = "Hello world STOP and more"
    for cut in range(1, len(text)):
        for cut2 in range(cut, len(text)):
            chunks = [text[:cut], text[cut:cut2], text[cut2:]]
            assert run(["STOP"], chunks) == ("Hello world ", True), chunks


def test_held_back_prefix_released_when_it_diverges() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xab").text == "x"  # "ab" may become "abc"
    check = matcher.feed("d")
    assert (check.text, check.stopped) == ("abd", False)


def test_earliest_stop_wins_and_flush_is_empty_after_stop() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    check = matcher.feed("Hello world")
    assert (check.text, check.stopped) == ("Hel", True)
    assert matcher.flush() == ""


def test_no_stop_strings_passes_through() -> None:
    assert run([], ["a", "b"]) == ("ab", False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n😀", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n😀", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_matches_a_search_of_the_whole_text(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run(stops, chunks) == expected(stops, chunks)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n😀", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n😀", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_included_stop_string_ends_the_output(text: str, stops: list[str], cuts: list[int]) -> None:
    """include_stop_str_in_output: the same stop point, and the output goes on to the end of
    the stop string found there (the first listed of those starting at that position)."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    excluded, stopped = expected(stops, chunks)
    got, got_stopped = run(stops, chunks, include=True)
    assert got_stopped == stopped
    if not stopped:
        assert got == excluded
        return
    seen = ""  # the text when generation stopped: a longer stop may complete only later
    for chunk in chunks:
        seen += chunk
        if any(s in seen for s in stops):
            break
    at = [s for s in stops if seen.find(s) == len(excluded)]
    assert at and got == excluded + at[0]
