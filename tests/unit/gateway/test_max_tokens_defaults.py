"""max_tokens omitted or null: OpenAI's defaults per endpoint, as the scheduler receives them.

/v1/completions: 16 (capped by the room the context leaves, as vLLM caps it; only a value the
client gave is refused for being too large). /v1/chat/completions: the rest of the context,
for `max_tokens` and `max_completion_tokens` alike.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared.protocol import RequestDelta, SubmitRequest
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

MAX_LEN = 64


pytestmark = pytest.mark.harness(max_model_len=MAX_LEN)


async def submitted(gateway: GatewayHarness, path: str, body: dict[str, Any]) -> SubmitRequest:
    """The SubmitRequest the body becomes (the request is then answered and finishes)."""
    task = asyncio.create_task(gateway.http.post(path, json={"model": MODEL_NAME, **body}))
    submit = await gateway.next_submit()
    await gateway.reply(
        RequestDelta(
            request_id=submit.request_id, start_index=0, token_ids=[2], finish_reason="stop"
        )
    )
    resp = await task
    assert resp.status_code == 200, resp.text
    return submit


@pytest.mark.parametrize("max_tokens", ["omitted", None])
async def test_completions_default_to_16(gateway: GatewayHarness, max_tokens: Any) -> None:
    body: dict[str, Any] = {"prompt": "Once upon a time"}
    if max_tokens != "omitted":
        body["max_tokens"] = max_tokens
    submit = await submitted(gateway, "/v1/completions", body)
    assert submit.sampling.max_tokens == 16


async def test_the_completions_default_is_capped_by_the_context(gateway: GatewayHarness) -> None:
    prompt = list(range(100, 100 + MAX_LEN - 5))  # leaves room for 5 tokens
    submit = await submitted(gateway, "/v1/completions", {"prompt": prompt})
    assert submit.sampling.max_tokens == 5
    resp = await gateway.http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


async def test_min_tokens_past_the_completions_default_is_a_400(gateway: GatewayHarness) -> None:
    resp = await gateway.http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "min_tokens": 17}
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "min_tokens"
    assert "16" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "limits",
    [{}, {"max_tokens": None}, {"max_completion_tokens": None}, {"max_tokens": None, "n": 1}],
)
async def test_chat_without_a_limit_may_use_the_rest_of_the_context(
    gateway: GatewayHarness, limits: dict[str, Any]
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **limits}
    submit = await submitted(gateway, "/v1/chat/completions", body)
    assert submit.sampling.max_tokens == MAX_LEN - len(submit.prompt_token_ids)


async def test_chat_max_completion_tokens_wins(gateway: GatewayHarness) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": None,
        "max_completion_tokens": 3,
    }
    submit = await submitted(gateway, "/v1/chat/completions", body)
    assert submit.sampling.max_tokens == 3
