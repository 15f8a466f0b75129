"""Tool calls through the gateway's HTTP API with the `llama3_json` parser (the e2e module runs
hermes on the whole mesh): the real router, planner and response path, a real Redis, and the
scheduler's side played by the test with the SmolLM2 tokenizer's ids of a Llama-style output.
A streamed and a whole answer of the same tokens say the same calls."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
BODY: dict[str, Any] = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Weather in Paris and Oslo?"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
    "max_tokens": 64,
}
OUTPUT = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
)


pytestmark = pytest.mark.harness(tool_call_parser="llama3_json")


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


async def test_llama_calls_in_a_body(gateway: GatewayHarness) -> None:
    posted = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=BODY))
    await gateway.answer(OUTPUT, pieces=3)
    resp = await posted
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls_of(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


async def test_llama_calls_streamed_token_by_token(gateway: GatewayHarness) -> None:
    body = {**BODY, "stream": True}
    posted = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=body))
    await gateway.answer(OUTPUT, pieces=len(gateway.tokenizer.encode(OUTPUT)))
    resp = await posted
    events = [
        json.loads(line.removeprefix("data: "))
        for line in resp.text.splitlines()
        if line.startswith("data: {")
    ]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    parts = [p for d in deltas for p in d["delta"].get("tool_calls", [])]
    calls: list[dict[str, Any]] = []
    for part in parts:
        if "id" in part:
            calls.append({"function": dict(part["function"])})
        else:
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    assert content == ""
    assert calls_of(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert resp.text.rstrip().endswith("data: [DONE]")


async def test_llama_plain_answer_is_content(gateway: GatewayHarness) -> None:
    posted = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=BODY))
    await gateway.answer("It is sunny in Paris.", pieces=2)
    choice = (await posted).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert choice["finish_reason"] == "stop"
