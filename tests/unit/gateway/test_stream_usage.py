"""`stream_options.continuous_usage_stats` (vLLM's): with include_usage, every chunk of a stream
carries its choice's usage so far, and the last one the request's; without it only the final
usage chunk has usage (OpenAI's). Real router, real Redis, the scheduler played by the test."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

ANSWER = "The capital of France is Paris, a city on the Seine."


async def streamed_chunks(gw: GatewayHarness, options: dict[str, Any]) -> list[dict[str, Any]]:
    body = {
        "model": MODEL_NAME,
        "prompt": "The capital of France",
        "max_tokens": 32,
        "stream": True,
        "stream_options": options,
    }
    posted = asyncio.create_task(gw.http.post("/v1/completions", json=body))
    await gw.answer(ANSWER, pieces=4)
    text = (await posted).text
    return [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: {")
    ]


async def test_every_chunk_carries_the_usage_so_far(gateway: GatewayHarness) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = await streamed_chunks(gateway, options)
    assert last["choices"] == []
    prompt = last["usage"]["prompt_tokens"]
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert len(chunks) == 4
    assert done == sorted(done) and done[0] > 0 and done[-1] == last["usage"]["completion_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert all(c["usage"]["total_tokens"] == prompt + d for c, d in zip(chunks, done, strict=True))


async def test_without_continuous_stats_only_the_last_chunk_has_usage(
    gateway: GatewayHarness,
) -> None:
    *chunks, last = await streamed_chunks(gateway, {"include_usage": True})
    assert all(c["usage"] is None for c in chunks) and last["usage"]["completion_tokens"] > 0
