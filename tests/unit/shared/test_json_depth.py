"""The nesting scan on raw JSON bytes against the depth of what json.loads builds."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import json_depth
from shared.json_depth import nesting_exceeds


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def nested(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


@pytest.mark.parametrize("limit", [0, 1, 2, 64, 1000])
def test_exactly_the_limit_passes_one_more_does_not(limit: int) -> None:
    assert not nesting_exceeds(nested(limit), limit)
    assert nesting_exceeds(nested(limit + 1), limit)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"1", 0),
        (b'"[[[[{{{{"', 0),  # brackets inside a string do not count
        (b'{"a": "[\\"[[", "b": [1]}', 2),  # an escaped quote does not end the string
        (b'["\\\\", [[]]]', 3),  # an escaped backslash does: the quote after it closes
        (b'["\\\\\\"[[[[", []]', 2),  # \\ then \" : still inside the string
        (b'{"k[": {"[": [{}]}}', 4),
        (b'"unterminated [[[[[', 0),  # nothing after an open quote is structure
    ],
)
def test_strings_and_escapes(text: bytes, expected: int) -> None:
    assert not nesting_exceeds(text, expected)
    if expected > 0:
        assert nesting_exceeds(text, expected - 1)


JSON_VALUES = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab,:'),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\k'), children, max_size=3)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, st.sampled_from([3, 7, 1 << 18]))
def test_agrees_with_the_parsed_depth_across_chunk_boundaries(value: Any, chunk: int) -> None:
    """Small chunks put every kind of boundary (inside a string, in a backslash run, between
    brackets) at a chunk edge."""
    text = json.dumps(value).encode()
    actual = depth(value)
    saved, json_depth.CHUNK = json_depth.CHUNK, chunk
    try:
        for limit in {max(0, actual - 1), actual, actual + 1}:
            assert nesting_exceeds(text, limit) == (actual > limit), (text, limit)
    finally:
        json_depth.CHUNK = saved


def test_large_texts_in_one_pass() -> None:
    prompt = json.dumps({"prompt": "the [quick] {brown} fox " * 200_000}).encode()  # 5 MB
    assert not nesting_exceeds(prompt, 1)
    flat = b"[" + b"[]," * 1_000_000 + b"[]]"  # a million shallow arrays: depth 2
    assert not nesting_exceeds(flat, 2) and nesting_exceeds(flat, 1)
    assert nesting_exceeds(b"[" * 5_000_000, 64)  # stops at the first level past the limit
