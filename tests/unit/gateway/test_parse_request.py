"""parse_request's refusal of lone surrogates, whichever way a body carries one. Most bodies
skip the walk over their values (no escape or bytes that could make one): these cases are the
ones that must still be walked and refused, and the ones that must still pass."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.api.errors import OpenAIError
from services.gateway.api.protocol_openai import ChatCompletionRequest, CompletionRequest
from services.gateway.api.protocol_openai import parse_request as parse

DEPTH = 64


def refused_param(cls: type[Any], raw: bytes) -> str | None:
    with pytest.raises(OpenAIError) as caught:
        parse(cls, raw, max_depth=DEPTH)
    assert caught.value.status == 400
    assert "lone UTF-16 surrogate" in str(caught.value)
    return caught.value.param


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (rb'{"prompt": "a\ud800b"}', "prompt"),  # escaped, lower case
        (rb'{"prompt": "a\uDBFFb"}', "prompt"),  # escaped, upper case
        (rb'{"prompt": "x", "stop": ["ok", "\udc00"]}', "stop[1]"),  # deep in a list
        (b'{"prompt": "a\xed\xa0\x80b"}', "prompt"),  # UTF-8-style bytes (surrogatepass)
    ],
)
def test_a_lone_surrogate_is_refused_with_its_field(raw: bytes, param: str) -> None:
    assert refused_param(CompletionRequest, raw) == param


def test_a_lone_surrogate_in_a_utf16_body_is_refused() -> None:
    # json.loads takes UTF-16 bytes too; there a surrogate is two bytes, no escape, no ED.
    raw = '{"prompt": "a\ud800b"}'.encode("utf-16-le", "surrogatepass")
    assert refused_param(CompletionRequest, raw) == "prompt"


def test_a_lone_surrogate_in_a_message_part_is_refused() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}
    raw = json.dumps(body, ensure_ascii=True).encode()
    assert refused_param(ChatCompletionRequest, raw) == "messages[0].content[0].text"


@pytest.mark.parametrize(
    "raw",
    [
        rb'{"prompt": "smile \uD83D\uDE00"}',  # an escaped pair is one character
        '{"prompt": "smile \U0001f600 \ud55c"}'.encode(),  # U+D55C is ED 95 9C: not a surrogate
        json.dumps({"prompt": list(range(512)), "stop": ["\n"]}).encode(),
    ],
)
def test_text_without_lone_surrogates_passes(raw: bytes) -> None:
    req = parse(CompletionRequest, raw, max_depth=DEPTH)
    assert req.prompt == [json.loads(raw)["prompt"]]
