"""Every validation rule through the real gateway: the bad value gets a 400 in OpenAI's error
shape naming the field (`error.param`), nothing reaches the requests stream, and the mesh goes
on serving afterwards.

Besides the rules of the API (context length, ranges, stop lists, messages, MoE-only fields),
the cases below the marker are inputs that once got past validation and failed deeper (a 500):
values the worker's int32/float32 tensors or msgpack cannot hold, token ids past the
vocabulary, lone surrogates, NaN. They stay here as regressions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from shared.streams import Streams
from tests.support.mesh import Mesh
from tests.support.stream_counts import entries_added

pytestmark = pytest.mark.e2e

USER = [{"role": "user", "content": "Hello"}]


def completion(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **fields}


def context_len(mesh: Mesh) -> int:
    return int(httpx.get(f"{mesh.api}/models", timeout=10).json()["data"][0]["max_model_len"])


# (id, route and body, or a builder taking the context length; the param the error names)
CASES: list[tuple[str, Any, str | None]] = [
    ("prompt-ids-fill-context", lambda n: completion(prompt=[1000] * n), "prompt"),
    ("prompt-text-past-context", lambda n: completion(prompt="hello " * n), "prompt"),
    (
        "chat-past-context",
        lambda n: chat(messages=[{"role": "user", "content": "hi " * n}]),
        "messages",
    ),
    ("max-tokens-0", completion(max_tokens=0), "max_tokens"),
    ("max-tokens-negative", chat(max_tokens=-3), "max_tokens"),
    ("max-tokens-past-context", lambda n: completion(max_tokens=n), "max_tokens"),
    (
        "max-completion-tokens-past-context",
        lambda n: chat(max_completion_tokens=n),
        "max_completion_tokens",
    ),
    ("n-0", completion(n=0), "n"),
    ("n-above-max", chat(n=17), "n"),
    ("top-p-0", completion(top_p=0), "top_p"),
    ("top-p-above-1", chat(top_p=1.01), "top_p"),
    ("temperature-negative", completion(temperature=-0.1), "temperature"),
    ("temperature-above-2", chat(temperature=2.5), "temperature"),
    ("top-logprobs-above-limit", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-without-logprobs", chat(top_logprobs=2), "top_logprobs"),
    ("logprobs-above-limit", completion(logprobs=21), "logprobs"),
    ("stop-not-strings", completion(stop=[1, 2]), "stop"),
    ("stop-empty-string", chat(stop=["ok", ""]), "stop"),
    ("stop-nested-list", completion(stop=[["a"]]), "stop"),
    ("stop-object", chat(stop={"a": 1}), "stop"),
    ("stop-too-many", completion(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("messages-empty", chat(messages=[]), "messages"),
    ("messages-not-a-list", chat(messages={"role": "user", "content": "hi"}), "messages"),
    ("role-unknown", chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ("role-missing", chat(messages=[{"content": "hi"}]), "messages[0].role"),
    ("user-without-content", chat(messages=[{"role": "user"}]), "messages[0].content"),
    (
        "image-part",
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "messages[0].content",
    ),
    ("routed-experts-non-moe", completion(return_routed_experts=True), "return_routed_experts"),
    ("routed-experts-chat-non-moe", chat(return_routed_experts=True), "return_routed_experts"),
    (
        "stream-options-without-stream",
        chat(stream_options={"include_usage": True}),
        "stream_options",
    ),
    ("min-tokens-above-max", completion(min_tokens=5, max_tokens=2), "min_tokens"),
    ("stop-token-id-past-vocab", completion(stop_token_ids=[10**9]), "stop_token_ids"),
    ("logit-bias-out-of-range", completion(logit_bias={"5": 101}), "logit_bias"),
    ("seed-negative", completion(seed=-1), "seed"),
    ("prompt-empty", completion(prompt=""), "prompt"),
    ("prompt-mixed-forms", completion(prompt=["a", 1]), "prompt"),
    ("suffix-unsupported", completion(suffix="x"), "suffix"),
    # --- regressions: these used to reach the engine or the encoder and come back as a 500
    ("top-k-past-int64", completion(top_k=2**64), "top_k"),
    (
        "repetition-penalty-past-float32",
        completion(repetition_penalty=1e308),
        "repetition_penalty",
    ),
    ("prompt-id-past-vocab-and-int64", completion(prompt=[[1], [10**20]]), "prompt"),
    ("prompt-id-past-vocab", completion(prompt=[49999999]), "prompt"),
    ("chat-min-tokens-past-context", chat(max_tokens=None, min_tokens=10**20), "min_tokens"),
    ("lone-surrogate-prompt", completion(prompt="a\ud800b"), "prompt"),
    (
        "lone-surrogate-message",
        chat(messages=[{"role": "user", "content": "\udfff"}]),
        "messages[0].content",
    ),
    (
        "lone-surrogate-regex",
        chat(structured_outputs={"regex": "\ud800"}),
        "structured_outputs.regex",
    ),
    ("lone-surrogate-model", completion(model="\ud800"), "model"),
]


@pytest.fixture(scope="module")
def requests_stream(mesh: Mesh) -> Iterator[Callable[[], int]]:
    """Entries ever added to the requests streams (the shared one and group 0's, where the
    router puts them): a refused request must never be queued."""
    client = redis.Redis.from_url(mesh.redis.url)
    streams = Streams(mesh.cluster)
    names = (streams.requests, streams.group_requests("0"))
    yield lambda: sum(entries_added(client, name) for name in names)
    client.close()


@pytest.mark.parametrize(("route_body", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_value_is_a_400_naming_the_field(
    mesh: Mesh, requests_stream: Any, route_body: Any, param: str
) -> None:
    route, body = route_body(context_len(mesh)) if callable(route_body) else route_body
    body = {k: v for k, v in body.items() if v is not None}
    queued = requests_stream()
    # json= would refuse lone surrogates; the gateway must handle the bytes a client may send.
    raw = httpx.Request("POST", "/", json=body).content if _encodable(body) else _raw_json(body)
    resp = httpx.post(
        f"{mesh.url('gateway')}{route}",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]
    assert requests_stream() == queued


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', "NaN"),
        (b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}', "Infinity"),
        (b'{"prompt": "hi", "max_tokens": 2', "not valid JSON"),
        (b'["prompt"]', "JSON object"),
        (b"\xff\xfe", "not valid JSON"),
    ],
    ids=["nan", "infinity", "truncated", "array", "not-utf8"],
)
def test_malformed_json_is_a_400(mesh: Mesh, requests_stream: Any, raw: bytes, needle: str) -> None:
    queued = requests_stream()
    resp = httpx.post(f"{mesh.api}/completions", content=raw, timeout=30)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    assert requests_stream() == queued


def test_unknown_model_is_a_404(mesh: Mesh) -> None:
    resp = httpx.post(f"{mesh.api}/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"


def test_the_mesh_still_serves_after_the_bad_requests(mesh: Mesh) -> None:
    for name in mesh.services:
        assert httpx.get(f"{mesh.url(name)}/health").status_code == 200, name
        assert httpx.get(f"{mesh.url(name)}/ready").status_code == 200, name
    resp = httpx.post(
        f"{mesh.api}/chat/completions",
        json={"messages": USER, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    # No refused request got as far as a worker step.
    assert mesh.admin_state("scheduler")["scheduler"]["num_step_failures"] == 0


def _encodable(body: dict[str, Any]) -> bool:
    try:
        httpx.Request("POST", "/", json=body)
    except UnicodeEncodeError:
        return False
    return True


def _raw_json(body: dict[str, Any]) -> bytes:
    """JSON with lone surrogates written as \\uXXXX escapes (valid JSON syntax)."""
    return json.dumps(body, ensure_ascii=True).encode()
