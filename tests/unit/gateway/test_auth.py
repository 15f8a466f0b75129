"""API keys guard /v1/*, /tokenize and /detokenize when set, with OpenAI's 401 body."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway.plan.tokenization import PromptTokenizer
from tests.unit.gateway.harness import MODEL_NAME, gateway_harness

ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"model": MODEL_NAME, "prompt": "Hi"}),
    ("POST", "/detokenize", {"model": MODEL_NAME, "tokens": [1, 2]}),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("POST", "/v1/chat/completions", {"messages": []}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
async def test_keys_required_when_configured(
    redis_url: str,
    tokenizer: PromptTokenizer,
    smollm2_dir: Path,
    method: str,
    path: str,
    body: dict | None,
) -> None:
    async with gateway_harness(redis_url, tokenizer, smollm2_dir, api_keys="k1, k2") as gw:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "k1"},
            {"Authorization": "Basic k1"},
        ):
            resp = await gw.http.request(method, path, json=body, headers=headers)
            assert resp.status_code == 401, (headers, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "invalid_api_key" and error["message"]
        ok = await gw.http.request(method, path, json=body, headers={"Authorization": "Bearer k2"})
        # Past auth: a 200, or the request's own validation error (never 401).
        assert ok.status_code in (200, 400), ok.text
        assert ok.status_code == 200 or ok.json()["error"]["type"] == "invalid_request_error"


async def test_open_without_keys(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    async with gateway_harness(redis_url, tokenizer, smollm2_dir) as gw:
        resp = await gw.http.get("/v1/models")
        assert resp.status_code == 200
        assert resp.json()["data"][0]["id"] == MODEL_NAME
