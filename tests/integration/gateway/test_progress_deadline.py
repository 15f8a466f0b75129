"""The gateway's progress deadline through its real HTTP app and bus (the test plays the
scheduler): a request that stops getting tokens ends with a clear 504 / error event naming the
bound, well before its total timeout, and is aborted on the scheduler; a request that keeps
progressing outlives the progress bound."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, gateway_harness

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50}
PROGRESS_S = 0.5


async def test_a_stalled_request_is_a_504_and_is_aborted(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    async with gateway_harness(
        redis_url, tokenizer, smollm2_dir, request_timeout_s=30, progress_timeout_s=PROGRESS_S
    ) as gw:
        started = time.monotonic()
        task = asyncio.create_task(gw.http.post("/v1/chat/completions", json=CHAT))
        sub = await gw.next_submit()
        await gw.reply(RequestDelta(request_id=sub.request_id, start_index=0, token_ids=[42]))
        resp = await task  # then silence: no token for PROGRESS_S
        assert resp.status_code == 504
        assert PROGRESS_S <= time.monotonic() - started < 10
        error = resp.json()["error"]
        assert error["code"] == "progress_timeout" and error["type"] == "timeout_error"
        assert "no progress for 0.5 s" in error["message"]
        abort = await gw.next_abort()
        assert (abort.request_id, abort.reason) == (sub.request_id, "timeout")
        assert gw.frontend.client.in_flight == 0


async def test_a_stalled_stream_ends_with_an_error_event_then_done(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    """No token at all (the first one is bounded too: a request lost before it started)."""
    async with gateway_harness(
        redis_url, tokenizer, smollm2_dir, request_timeout_s=30, progress_timeout_s=PROGRESS_S
    ) as gw:
        resp = await gw.http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status_code == 200  # the stream had begun: the error is in it
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 504 and "no progress for 0.5 s" in error["message"]
        assert (await gw.next_abort()).reason == "timeout"


async def test_steady_progress_outlives_the_progress_bound(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    async with gateway_harness(
        redis_url, tokenizer, smollm2_dir, request_timeout_s=30, progress_timeout_s=PROGRESS_S
    ) as gw:
        task = asyncio.create_task(gw.http.post("/v1/chat/completions", json=CHAT))
        sub = await gw.next_submit()
        for i in range(6):  # 6 gaps of PROGRESS_S / 2: 1.5 s in all, three times the bound
            await asyncio.sleep(PROGRESS_S / 2)
            last = i == 5
            delta = RequestDelta(
                request_id=sub.request_id,
                start_index=i,
                token_ids=[42],
                finish_reason="length" if last else None,
            )
            await gw.reply(delta)
        resp = await task
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
