"""Hostile bodies get a clean 4xx and nothing is queued: JSON nested past the limit is a 400
(anywhere: an unknown field, a schema, a spec sent as a string), a body past the size limit a
413 (declared or streamed), each exactly at its boundary.

The real router with the SmolLM2 tokenizer and a real Redis behind the bus; bodies stay under
the planning pool's inline size, so they are planned in the test's process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.gateway.plan.planning_pool import INLINE_BELOW_BYTES
from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness, gateway_harness

DEPTH = 8
MAX_BYTES = 2048
assert MAX_BYTES < INLINE_BELOW_BYTES
COMPLETION: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
CHAT: dict[str, Any] = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 2,
}


pytestmark = pytest.mark.harness(max_json_depth=DEPTH, max_body_bytes=MAX_BYTES, max_model_len=64)


def arrays(levels: int) -> Any:
    """`levels` nested lists: json depth `levels`."""
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


async def post(gateway: GatewayHarness, path: str, body: bytes | dict[str, Any]) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await gateway.http.post(path, content=raw, headers={"content-type": "application/json"})


async def served(gateway: GatewayHarness, path: str, body: dict[str, Any]) -> None:
    """The request reaches the bus and is answered."""
    task = asyncio.create_task(post(gateway, path, body))
    submit = await gateway.next_submit()
    await gateway.reply(
        RequestDelta(
            request_id=submit.request_id, start_index=0, token_ids=[2], finish_reason="stop"
        )
    )
    resp = await task
    assert resp.status_code == 200, resp.text


async def refused(gateway: GatewayHarness, path: str, body: bytes | dict[str, Any]) -> Any:
    resp = await post(gateway, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert await gateway.entries_added(gateway.streams.requests) == 0
    return error


# --- nesting --------------------------------------------------------------------------------


async def test_an_unknown_field_nested_to_the_limit_passes_one_level_more_is_a_400(
    gateway: GatewayHarness,
) -> None:
    at_limit = {**COMPLETION, "extra": {"x": arrays(DEPTH - 2)}}
    assert depth(at_limit) == DEPTH
    past = {**COMPLETION, "extra": {"x": arrays(DEPTH - 1)}}
    error = await refused(gateway, "/v1/completions", past)
    assert f"more than {DEPTH} levels deep" in error["message"]
    assert "MESHLLM_MAX_JSON_DEPTH" in error["message"]
    await served(gateway, "/v1/completions", at_limit)


def schema_of_depth(levels: int) -> dict[str, Any]:
    """A valid JSON schema whose own JSON nests `levels` deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    assert depth(schema) == levels
    return schema


def with_schema(schema: dict[str, Any]) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {**CHAT, "response_format": fmt}


async def test_a_response_format_schema_one_level_past_the_limit_is_a_400(
    gateway: GatewayHarness,
) -> None:
    # body -> response_format -> json_schema -> schema: the schema itself starts at level 4
    past = with_schema(schema_of_depth(DEPTH - 2))
    assert depth(past) == DEPTH + 1
    error = await refused(gateway, "/v1/chat/completions", past)
    assert "levels deep" in error["message"]


async def test_a_schema_sent_as_a_string_gets_the_same_limit(gateway: GatewayHarness) -> None:
    text = json.dumps(schema_of_depth(DEPTH + 1))
    body = {**CHAT, "structured_outputs": {"json": text}}
    error = await refused(gateway, "/v1/chat/completions", body)
    assert error["param"] == "structured_outputs.json" and "levels deep" in error["message"]
    tag = json.dumps({"structures": arrays(DEPTH + 1), "triggers": []})
    body = {**CHAT, "structured_outputs": {"structural_tag": tag}}
    error = await refused(gateway, "/v1/chat/completions", body)
    assert error["param"] == "structured_outputs.structural_tag"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b"[" * 1_000 + b"]" * 1_000),
        ("/v1/chat/completions", b'{"messages": ' + b"[" * 990 + b"]" * 990 + b"}"),
        ("/tokenize", b'{"prompt": "a", "x": ' + b"[" * 1_000 + b"]" * 1_000 + b"}"),
        ("/detokenize", b'{"tokens": [1], "x": ' + b"[" * 1_000 + b"]" * 1_000 + b"}"),
    ],
)
async def test_hostile_nesting_is_a_400_on_every_endpoint(
    gateway: GatewayHarness, path: str, body: bytes
) -> None:
    resp = await post(gateway, path, body)
    assert resp.status_code == 400, resp.text
    assert "levels deep" in resp.json()["error"]["message"]


async def test_the_operators_cases_through_the_planning_processes(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    """The default limits, with bodies large enough for the planning processes: the 400 is
    made there and crosses back intact (status, message, param)."""
    async with gateway_harness(redis_url, tokenizer, smollm2_dir, max_model_len=64) as gateway:
        deep_schema: dict[str, Any] = {"type": "string"}
        for _ in range(300):
            deep_schema = {"type": "object", "properties": {"a": deep_schema}}
        cases = [
            ("/v1/completions", b"[" * 50_000 + b"]" * 50_000),
            ("/v1/completions", b"[" * 3_000 + b"]" * 3_000),
            (
                "/v1/completions",
                b'{"prompt": "%s", "x": ' % (b"a" * 3000) + b"[" * 990 + b"]" * 990 + b"}",
            ),
            ("/v1/chat/completions", json.dumps(with_schema(deep_schema)).encode()),
        ]
        for path, body in cases:
            assert len(body) >= INLINE_BELOW_BYTES
            error = await refused(gateway, path, body)
            assert "more than 64 levels deep" in error["message"], error
        text = json.dumps(deep_schema)
        body = {**CHAT, "structured_outputs": {"json": text}, "pad": "x" * INLINE_BELOW_BYTES}
        error = await refused(gateway, "/v1/chat/completions", body)
        assert error["param"] == "structured_outputs.json"


async def test_nesting_past_python_recursion_under_a_raised_limit_is_still_a_400(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    """An operator may raise MESHLLM_MAX_JSON_DEPTH past what Python's parser and jsonschema
    can recurse: that is a 400 too, never a 500."""
    async with gateway_harness(
        redis_url, tokenizer, smollm2_dir, max_json_depth=100_000, max_model_len=64
    ) as gateway:
        body = b'{"prompt": "a", "x": ' + b"[" * 2_000 + b"]" * 2_000 + b"}"
        assert len(body) < INLINE_BELOW_BYTES
        error = await refused(gateway, "/v1/completions", body)
        assert "nested too deeply" in error["message"]
        props: dict[str, Any] = {"type": "string"}
        for _ in range(400):
            props = {"anyOf": [props]}
        text = json.dumps(props)
        error = await refused(
            gateway, "/v1/chat/completions", {**CHAT, "structured_outputs": {"json": text}}
        )
        assert error["param"] == "structured_outputs.json"


# --- size -----------------------------------------------------------------------------------


def padded(body: dict[str, Any], size: int) -> bytes:
    """`body` as JSON, padded with trailing whitespace (still valid JSON) to `size` bytes."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


async def test_a_body_of_exactly_the_limit_passes_one_byte_more_is_a_413(
    gateway: GatewayHarness,
) -> None:
    resp = await post(gateway, "/v1/completions", padded(COMPLETION, MAX_BYTES + 1))
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["code"] == "request_too_large" and str(MAX_BYTES) in error["message"]
    assert await gateway.entries_added(gateway.streams.requests) == 0
    task = asyncio.create_task(post(gateway, "/v1/completions", padded(COMPLETION, MAX_BYTES)))
    submit = await gateway.next_submit()
    await gateway.reply(
        RequestDelta(
            request_id=submit.request_id, start_index=0, token_ids=[2], finish_reason="stop"
        )
    )
    assert (await task).status_code == 200


async def chunks(raw: bytes, size: int = 100) -> AsyncIterator[bytes]:
    for start in range(0, len(raw), size):
        yield raw[start : start + size]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/detokenize"])
async def test_a_streamed_body_without_length_is_cut_off_at_the_limit(
    gateway: GatewayHarness, path: str
) -> None:
    raw = padded(CHAT, MAX_BYTES + 1)
    resp = await gateway.http.post(path, content=chunks(raw))  # chunked: no Content-Length
    assert "content-length" not in resp.request.headers
    assert resp.status_code == 413, resp.text
    ok = padded({"model": MODEL_NAME, "prompt": "Hi"}, MAX_BYTES)
    resp = await gateway.http.post("/tokenize", content=chunks(ok))
    assert resp.status_code == 200, resp.text


async def test_a_declared_length_past_the_limit_is_refused_before_the_body_is_sent(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    """Over a real socket: headers announcing 1 GB and no body at all still get their 413,
    so the gateway did not wait to read it."""
    async with gateway_harness(
        redis_url, tokenizer, smollm2_dir, serve=True, max_body_bytes=MAX_BYTES
    ) as gateway:
        host, port = gateway.base_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        await writer.drain()
        async with asyncio.timeout(10):
            status = await reader.readline()
        writer.close()
        assert status.startswith(b"HTTP/1.1 413"), status
