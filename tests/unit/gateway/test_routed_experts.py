"""CONTRACTS.md "Routed-experts offset is validated at the edge", on a tiny real MoE config.

`0 <= start <= prompt_len`: -1 and prompt_len + 1 are refused (never clamped) and never reach the
requests stream; start == prompt_len is accepted and returns no prompt rows; the response has
one row per returned position, each a list over MoE layers of the top-k expert ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.gateway.api.protocol_openai import ChatMessage
from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness, gateway_harness

LAYERS, TOP_K = 2, 2
PROMPT = "Route these tokens"


@pytest.fixture
async def gateway(
    redis_url: str, tokenizer: PromptTokenizer, moe_dir: Path
) -> AsyncIterator[GatewayHarness]:
    async with gateway_harness(redis_url, tokenizer, moe_dir) as harness:
        yield harness


def body(start: int | None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 2,
        "return_routed_experts": True,
        **extra,
    }
    if start is not None:
        out["routed_experts_prompt_start"] = start
    return out


def rows(first: int, count: int) -> list[int]:
    """`count` rows of [LAYERS][TOP_K] expert ids, distinct per row so order is checked."""
    return [(first + r) * 10 + i for r in range(count) for i in range(LAYERS * TOP_K)]


def nested(flat: list[int]) -> list[list[list[int]]]:
    width = LAYERS * TOP_K
    return [
        [flat[p * width + m * TOP_K : p * width + (m + 1) * TOP_K] for m in range(LAYERS)]
        for p in range(len(flat) // width)
    ]


@pytest.mark.parametrize("offset", [-1, 1])
async def test_out_of_range_start_is_refused_and_never_queued(
    gateway: GatewayHarness, tokenizer: PromptTokenizer, offset: int
) -> None:
    prompt_len = len(tokenizer.encode(PROMPT))
    start = -1 if offset < 0 else prompt_len + offset
    resp = await gateway.http.post("/v1/completions", json=body(start))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "routed_experts_prompt_start"
    assert f"[0, {prompt_len}]" in error["message"]
    assert await gateway.entries_added(gateway.streams.requests) == 0


@pytest.mark.parametrize("where", ["end", "start", "middle", "default"])
async def test_valid_start_reaches_the_stream_and_rows_come_back(
    gateway: GatewayHarness, tokenizer: PromptTokenizer, where: str
) -> None:
    prompt_len = len(tokenizer.encode(PROMPT))
    start = {"end": prompt_len, "start": 0, "middle": prompt_len // 2, "default": None}[where]
    task = asyncio.create_task(gateway.http.post("/v1/completions", json=body(start)))
    submit = await gateway.next_submit()
    expect_start = 0 if start is None else start
    assert submit.return_routed_experts
    assert submit.routed_experts_prompt_start == expect_start
    prompt_rows = prompt_len - expect_start
    tokens = tokenizer.encode(" ok.", add_special_tokens=False)[:2]
    flat = rows(0, prompt_rows + len(tokens))
    await gateway.reply(
        RequestDelta(
            request_id=submit.request_id,
            start_index=0,
            token_ids=tokens,
            routed_experts=flat,
            routed_experts_shape=[prompt_rows + len(tokens), LAYERS, TOP_K],
            finish_reason="length",
        )
    )
    resp = await task
    assert resp.status_code == 200, resp.text
    routed = resp.json()["choices"][0]["routed_experts"]
    assert routed == nested(flat)
    assert len(routed) == prompt_rows + len(tokens)  # zero prompt rows when start == prompt_len


async def test_moe_chat_start_checked_against_the_templated_prompt(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt_len = len(tokenizer.chat_prompt([ChatMessage(role="user", content="Hi")]).token_ids)
    chat = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": 1,
        "return_routed_experts": True,
    }
    bad = await gateway.http.post(
        "/v1/chat/completions", json={**chat, "routed_experts_prompt_start": prompt_len + 1}
    )
    assert bad.status_code == 400
    task = asyncio.create_task(
        gateway.http.post(
            "/v1/chat/completions", json={**chat, "routed_experts_prompt_start": prompt_len}
        )
    )
    submit = await gateway.next_submit()
    assert submit.routed_experts_prompt_start == prompt_len == len(submit.prompt_token_ids)
    await gateway.reply(
        RequestDelta(
            request_id=submit.request_id,
            start_index=0,
            token_ids=[5],
            routed_experts=rows(0, 1),
            routed_experts_shape=[1, LAYERS, TOP_K],
            finish_reason="length",
        )
    )
    resp = await task
    assert resp.json()["choices"][0]["routed_experts"] == nested(rows(0, 1))
