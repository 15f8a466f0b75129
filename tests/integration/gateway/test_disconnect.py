"""A client that goes away, or a request past its deadline, publishes AbortRequests; the freed
slots take new requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness, gateway_harness

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a story"}],
    "max_tokens": 100,
}


pytestmark = pytest.mark.harness(serve=True)


async def test_stream_disconnect_mid_stream_aborts_every_choice(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(" Once upon a time", add_special_tokens=False)
    async with (
        httpx.AsyncClient(base_url=gateway.base_url) as http,
        http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True, "n": 2}) as resp,
    ):
        subs = [await gateway.next_submit(), await gateway.next_submit()]
        await gateway.reply(
            *(RequestDelta(request_id=s.request_id, start_index=0, token_ids=ids[:2]) for s in subs)
        )
        lines = resp.aiter_lines()
        seen = ""
        while "Once" not in seen:  # content has arrived: we are mid-stream
            seen += await anext(lines)
        # Leaving the block closes the connection with the stream unfinished.
    aborts = {
        (a.request_id, a.reason) for a in [await gateway.next_abort(), await gateway.next_abort()]
    }
    assert aborts == {(s.request_id, "client") for s in subs}
    assert gateway.frontend.client.in_flight == 0
    # Later replies for the aborted ids are dropped without harm.
    await gateway.reply(
        RequestDelta(
            request_id=subs[0].request_id, start_index=2, token_ids=ids[2:], finish_reason="length"
        )
    )


def aborted_count() -> float:
    labels = {"model_name": MODEL_NAME, "finished_reason": "abort"}
    return REGISTRY.get_sample_value("meshllm:request_success_total", labels) or 0.0


async def test_non_streaming_disconnect_aborts(gateway: GatewayHarness) -> None:
    before = aborted_count()
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        task = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
        sub = await gateway.next_submit()
        task.cancel()  # the client gives up and closes its connection
        with pytest.raises(asyncio.CancelledError):
            await task
    abort = await gateway.next_abort()
    assert (abort.request_id, abort.reason) == (sub.request_id, "client")
    assert aborted_count() == before + 1


async def test_finished_request_sends_no_abort(gateway: GatewayHarness) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        task = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT))
        sub = await gateway.next_submit()
        await gateway.reply(
            RequestDelta(
                request_id=sub.request_id, start_index=0, token_ids=[42], finish_reason="length"
            )
        )
        assert (await task).status_code == 200
    await gateway.frontend.client.stop()  # waits for any abort still being published
    assert await gateway.entries_added(gateway.streams.aborts) == 0


async def test_timeout_is_a_504_and_aborts(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    async with gateway_harness(redis_url, tokenizer, smollm2_dir, request_timeout_s=0.2) as gw:
        resp = await gw.http.post("/v1/chat/completions", json=CHAT)  # no scheduler answers
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "timeout"
        abort = await gw.next_abort()
        assert abort.reason == "timeout"
        assert gw.frontend.client.in_flight == 0
