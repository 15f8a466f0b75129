"""A reasoning model's answer through the gateway's HTTP API with MESHLLM_REASONING_PARSER=qwen3:
the real router, planner and response path, a real Redis, the scheduler's side played by the
test with the SmolLM2 tokenizer's ids of a Qwen3-style output. Streamed and whole, the
thinking comes back as `reasoning_content` and the answer as `content`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

BODY: dict[str, Any] = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Capital of France?"}],
    "max_tokens": 64,
}
THOUGHT = "The user asks for the capital of France. It is Paris."
THINKING = f"<think>\n{THOUGHT}\n</think>"
OUTPUT = f"{THINKING}\n\nParis."


def thinking_tokens(gateway: GatewayHarness) -> int:
    """The output's reasoning tokens: the thinking's, tags included (it tokenizes apart from
    the answer here, so the count is exact)."""
    encode = gateway.tokenizer.encode
    thinking = encode(THINKING, add_special_tokens=False)
    assert encode(OUTPUT, add_special_tokens=False)[: len(thinking)] == thinking
    return len(thinking)


pytestmark = pytest.mark.harness(reasoning_parser="qwen3")


async def test_thinking_apart_from_the_answer_in_a_body(gateway: GatewayHarness) -> None:
    posted = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=BODY))
    await gateway.answer(OUTPUT, pieces=4)
    body = (await posted).json()
    choice = body["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "\n\nParis.",
        "reasoning_content": f"\n{THOUGHT}\n",
    }
    assert choice["finish_reason"] == "stop"
    # counted per token though the deltas held several tokens each
    details = {"reasoning_tokens": thinking_tokens(gateway)}
    assert body["usage"]["completion_tokens_details"] == details


async def test_thinking_apart_from_the_answer_streamed(gateway: GatewayHarness) -> None:
    streamed = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    posted = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=streamed))
    await gateway.answer(OUTPUT, pieces=len(gateway.tokenizer.encode(OUTPUT)))
    text = (await posted).text
    *chunks, last = [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: {")
    ]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    details = {"reasoning_tokens": thinking_tokens(gateway)}
    assert last["usage"]["completion_tokens_details"] == details
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (f"\n{THOUGHT}\n", "\n\nParis.")
    # The thinking streamed as it came: several chunks carry it.
    assert sum("reasoning_content" in d for d in deltas) > 5


async def test_an_answer_without_thinking_is_content(gateway: GatewayHarness) -> None:
    posted = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=BODY))
    await gateway.answer("Paris.", pieces=1)
    body = (await posted).json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": None}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
