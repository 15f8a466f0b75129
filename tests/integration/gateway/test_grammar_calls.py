"""The gateway's calls to the grammar service over the bus, through its HTTP API: an invalid spec
is a 400 naming the request field; no grammar service, or one that stopped answering, is a 503
for constrained requests only; nothing that failed to compile is queued."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from services.gateway.plan.tokenization import PromptTokenizer
from shared.bus import Bus
from shared.protocol import RequestDelta
from shared.protocol.grammar import MAX_SPEC_CHARS
from shared.streams import RPC_GROUP, Streams
from tests.support.grammar_server import grammar_service
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness, gateway_harness

CONSTRAINED = {"structured_outputs": {"choice": ["up", "down"]}}


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Up or down?"}],
        "max_tokens": 2,
        **extra,
    }


pytestmark = pytest.mark.harness(grammar_timeout_s=0.5)


async def test_an_invalid_spec_is_a_400_naming_the_field_and_nothing_is_queued(
    redis_url: str, smollm2_dir: Path, gateway: GatewayHarness
) -> None:
    async with grammar_service(redis_url, smollm2_dir):
        resp = await gateway.http.post(
            "/v1/chat/completions", json=chat(structured_outputs={"regex": "a(b"})
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "structured_outputs.regex"
        assert error["message"].startswith("invalid regex: ") and "parenthesis" in error["message"]
        schema = {"type": "array", "uniqueItems": True}
        resp = await gateway.http.post(
            "/v1/chat/completions",
            json=chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                }
            ),
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "response_format.json_schema.schema"
    assert await gateway.entries_added(gateway.streams.requests) == 0


async def test_a_spec_too_long_for_the_protocol_is_a_400(gateway: GatewayHarness) -> None:
    resp = await gateway.http.post(
        "/v1/chat/completions",
        json=chat(structured_outputs={"regex": "a" * (MAX_SPEC_CHARS + 1)}),
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "structured_outputs.regex"
    assert "at most" in resp.json()["error"]["message"]


async def test_no_grammar_service_is_a_503_at_once_for_constrained_requests_only(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    timeout_s = 120.0  # far longer than any answer here: a 503 before it is not a timeout
    async with gateway_harness(
        redis_url, tokenizer, smollm2_dir, grammar_timeout_s=timeout_s
    ) as gateway:
        started = time.monotonic()
        resp = await gateway.http.post("/v1/chat/completions", json=chat(**CONSTRAINED))
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "grammar_service_unavailable"
        assert "grammar service" in resp.json()["error"]["message"]
        # Nobody ever served the stream: refused at once, not after the call's timeout.
        assert time.monotonic() - started < timeout_s / 2
        assert await gateway.entries_added(gateway.streams.requests) == 0
        await assert_unconstrained_requests_still_go_through(gateway)


async def test_a_grammar_service_that_stopped_answering_is_a_503_after_the_timeout(
    redis_url: str, gateway: GatewayHarness
) -> None:
    bus = Bus(redis_url, "grammar-gone")
    await bus.connect()
    await bus.ensure_group(Streams().calls("grammar"), RPC_GROUP)  # it ran once, and died
    await bus.close()
    started = time.monotonic()
    resp = await gateway.http.post("/v1/chat/completions", json=chat(**CONSTRAINED))
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "grammar_service_unavailable"
    assert "no answer" in resp.json()["error"]["message"]
    assert time.monotonic() - started >= 0.5  # grammar_timeout_s
    assert await gateway.entries_added(gateway.streams.requests) == 0
    await assert_unconstrained_requests_still_go_through(gateway)


async def assert_unconstrained_requests_still_go_through(gateway: GatewayHarness) -> None:
    task = asyncio.create_task(gateway.http.post("/v1/chat/completions", json=chat()))
    sub = await gateway.next_submit()
    assert sub.grammar is None
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id, start_index=0, token_ids=[42], finish_reason="length"
        )
    )
    assert (await task).status_code == 200
