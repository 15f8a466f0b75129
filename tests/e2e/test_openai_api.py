"""The OpenAI API through the real mesh (gateway + scheduler + worker processes), spoken to by
the `openai` package: answers, usage, streaming == non-streaming, n, length limits, stop strings
across token boundaries, and non-ASCII text streamed without broken characters.

Greedy (temperature 0) outputs are deterministic, so a first run can be compared with a second
one (streamed, limited, stopped). Expected values are computed from first runs and from
/tokenize, never written into the test.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
JAPANESE = [{"role": "user", "content": "Write a short greeting in Japanese."}]
COMPLETION_PROMPT = "The capital of France is"


def tokenize(mesh: Mesh, body: dict[str, Any]) -> list[int]:
    resp = httpx.post(f"{mesh.url('gateway')}/tokenize", json=body, timeout=30)
    resp.raise_for_status()
    out = resp.json()
    assert out["count"] == len(out["tokens"])
    return list(out["tokens"])


# --- answers and usage ------------------------------------------------------------------------


def test_chat_capital_of_france_with_exact_usage(
    client: openai.OpenAI, model_name: str, mesh: Mesh
) -> None:
    resp = client.chat.completions.create(
        model=model_name, messages=FRANCE, temperature=0, max_tokens=24, logprobs=True
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(tokenize(mesh, {"messages": FRANCE}))
    # One logprobs entry per generated token; the stop token (when it ended the output) counts
    # and has an entry but no text, so the other entries' bytes spell the content exactly.
    entries = choice.logprobs.content
    assert resp.usage.completion_tokens == len(entries)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    texts = entries[:-1] if choice.finish_reason == "stop" else entries
    assert b"".join(bytes(e.bytes) for e in texts) == choice.message.content.encode()


def test_completion_max_tokens_gives_length_and_exact_usage(
    client: openai.OpenAI, model_name: str, mesh: Mesh
) -> None:
    resp = client.completions.create(
        model=model_name, prompt=COMPLETION_PROMPT, temperature=0, max_tokens=5, logprobs=0
    )
    choice = resp.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 5
    assert "".join(choice.logprobs.tokens) == choice.text
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(tokenize(mesh, {"prompt": COMPLETION_PROMPT}))
    assert resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 5


def test_chat_max_tokens_gives_length(client: openai.OpenAI, model_name: str) -> None:
    resp = client.chat.completions.create(
        model=model_name,
        messages=FRANCE,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    assert len(resp.choices[0].logprobs.content) == 5
    assert resp.usage is not None and resp.usage.completion_tokens == 5


@pytest.mark.parametrize("max_tokens", ["omitted", None])
def test_completion_without_max_tokens_stops_at_openais_16(
    mesh: Mesh, model_name: str, max_tokens: Any
) -> None:
    """OpenAI's default for /v1/completions, also for an explicit null (ignore_eos: the model
    would go on)."""
    body: dict[str, Any] = {
        "model": model_name,
        "prompt": COMPLETION_PROMPT,
        "temperature": 0,
        "ignore_eos": True,
    }
    if max_tokens != "omitted":
        body["max_tokens"] = max_tokens
    resp = httpx.post(f"{mesh.api}/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 16


# --- streaming --------------------------------------------------------------------------------


def test_streamed_chat_equals_non_streamed_with_usage_chunk(
    client: openai.OpenAI, model_name: str
) -> None:
    args: dict[str, Any] = {"model": model_name, "messages": FRANCE, "max_tokens": 12}
    # the prompt's blocks cached first, so both requests report the same cached_tokens (on a
    # fresh mesh the first would miss and the second hit, whatever ran before in the module)
    client.chat.completions.create(**args, temperature=0)
    whole = client.chat.completions.create(**args, temperature=0)
    chunks = list(
        client.chat.completions.create(
            **args, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    *content_chunks, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in content_chunks)
    assert {c.id for c in chunks} == {chunks[0].id}
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]


def test_streamed_completion_equals_non_streamed_with_usage_chunk(
    client: openai.OpenAI, model_name: str
) -> None:
    args: dict[str, Any] = {"model": model_name, "prompt": COMPLETION_PROMPT, "max_tokens": 8}
    whole = client.completions.create(**args, temperature=0)
    chunks = list(
        client.completions.create(
            **args, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    *content_chunks, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()
    assert "".join(c.choices[0].text for c in content_chunks) == whole.choices[0].text
    assert content_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stream_without_include_usage_has_no_usage_chunk(
    client: openai.OpenAI, model_name: str
) -> None:
    chunks = list(
        client.completions.create(
            model=model_name, prompt=COMPLETION_PROMPT, max_tokens=3, temperature=0, stream=True
        )
    )
    assert chunks and all(c.choices and c.usage is None for c in chunks)


# --- n ----------------------------------------------------------------------------------------


def test_n2_completion_gives_two_indexed_choices(client: openai.OpenAI, model_name: str) -> None:
    resp = client.completions.create(
        model=model_name,
        prompt=COMPLETION_PROMPT,
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    # The seed makes the request reproducible, choice by choice.
    again = client.completions.create(
        model=model_name,
        prompt=COMPLETION_PROMPT,
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    by_index = {c.index: c.text for c in resp.choices}
    assert {c.index: c.text for c in again.choices} == by_index


def test_n2_streamed_chat_interleaves_both_choices(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=FRANCE,
            n=2,
            max_tokens=3,
            temperature=1.0,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finishes = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in chunks
        if c.choices[0].finish_reason is not None
    }
    assert finishes == {0: "length", 1: "length"}
    roles = sorted(c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant")
    assert roles == [0, 1]


# --- stop strings -----------------------------------------------------------------------------


def boundary_stop(tokens: list[str]) -> tuple[str, int, int]:
    """A stop string crossing the boundary between two greedy tokens, found at its first
    occurrence: (stop, where it starts in the text, index of the token that completes it)."""
    text = "".join(tokens)
    offset = 0
    for i in range(1, len(tokens)):
        offset += len(tokens[i - 1])
        left, right = tokens[i - 1][-2:], tokens[i][:2]
        stop = left + right
        if left.strip() and right.strip() and text.find(stop) == offset - len(left):
            return stop, offset - len(left), i
    raise AssertionError(f"no usable token boundary in {tokens!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_across_tokens_is_honoured_and_excluded(
    client: openai.OpenAI, model_name: str, stream: bool
) -> None:
    args: dict[str, Any] = {
        "model": model_name,
        "prompt": COMPLETION_PROMPT,
        "temperature": 0,
        "max_tokens": 16,
    }
    first = client.completions.create(**args, logprobs=0)
    tokens = first.choices[0].logprobs.tokens
    assert "".join(tokens) == first.choices[0].text  # ASCII output: token texts are exact
    stop, start, completing = boundary_stop(tokens)

    if stream:
        chunks = list(
            client.completions.create(
                **args, stop=[stop], stream=True, stream_options={"include_usage": True}
            )
        )
        *content, usage_chunk = chunks
        text = "".join(c.choices[0].text for c in content)
        finish = content[-1].choices[0].finish_reason
        usage = usage_chunk.usage
    else:
        resp = client.completions.create(**args, stop=[stop])
        text, finish, usage = resp.choices[0].text, resp.choices[0].finish_reason, resp.usage
    assert text == first.choices[0].text[:start]
    assert finish == "stop"
    # The output ends at the token that completed the stop string; later ones are not counted.
    assert usage is not None and usage.completion_tokens == completing + 1


# --- non-ASCII text ---------------------------------------------------------------------------


def clean_cut(pieces: list[bytes]) -> int:
    """The largest k such that the first k tokens' bytes are whole UTF-8 characters and some
    character among them is split over two tokens."""
    for k in range(len(pieces), 0, -1):
        try:
            text = b"".join(pieces[:k]).decode("utf-8")
        except UnicodeDecodeError:
            continue
        split_char = any(_partial(p) for p in pieces[:k])
        if split_char and "\ufffd" not in text:
            return k
    raise AssertionError("the greedy output has no character split over tokens")


def _partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_non_ascii_streams_whole_characters(
    client: openai.OpenAI, model_name: str, mesh: Mesh
) -> None:
    first = client.chat.completions.create(
        model=model_name, messages=JAPANESE, temperature=0, max_tokens=16, logprobs=True
    )
    pieces = [bytes(e.bytes) for e in first.choices[0].logprobs.content]
    k = clean_cut(pieces)
    expected = b"".join(pieces[:k]).decode("utf-8")
    assert any(ord(ch) > 127 for ch in expected)

    body = {"model": model_name, "messages": JAPANESE, "temperature": 0, "max_tokens": k}
    whole = client.chat.completions.create(**body)
    assert whole.choices[0].message.content == expected

    # Raw SSE bytes: every event must be valid UTF-8 on its own, with no replacement character.
    streamed = []
    url = f"{mesh.api}/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        for raw in resp.iter_raw():
            streamed.append(raw)
    events = [e for e in b"".join(streamed).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    text = ""
    for event in events[:-1]:
        assert event.startswith(b"data: ")
        chunk = json.loads(event[len(b"data: ") :].decode("utf-8"))  # strict decoding
        piece = chunk["choices"][0]["delta"].get("content") or ""
        assert "\ufffd" not in piece
        text += piece
    assert text == expected


# --- auth off ---------------------------------------------------------------------------------


def test_without_api_keys_no_authorization_is_needed(mesh: Mesh, model_name: str) -> None:
    resp = httpx.post(
        f"{mesh.api}/completions",
        json={"model": model_name, "prompt": "Hi", "max_tokens": 1},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 1
