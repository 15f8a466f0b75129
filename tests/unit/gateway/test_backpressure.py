"""Past max_pending_requests in flight: 429 with an OpenAI body and Retry-After; slots free up
when requests finish."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, gateway_harness

BODY = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}


async def test_429_past_the_limit_then_accepted_again(
    redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    async with gateway_harness(redis_url, tokenizer, smollm2_dir, max_pending_requests=2) as gw:
        first = asyncio.create_task(gw.http.post("/v1/completions", json={**BODY, "n": 2}))
        submits = [await gw.next_submit(), await gw.next_submit()]  # both slots taken
        assert gw.frontend.client.in_flight == 2

        refused = await gw.http.post("/v1/completions", json=BODY)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert await gw.entries_added(gw.streams.requests) == 2  # the refused one was not queued

        too_big = await gw.http.post("/v1/completions", json={**BODY, "n": 3})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "n"

        await gw.reply(
            *(
                RequestDelta(
                    request_id=s.request_id, start_index=0, token_ids=[9], finish_reason="length"
                )
                for s in submits
            )
        )
        assert (await first).status_code == 200
        assert gw.frontend.client.in_flight == 0

        again = asyncio.create_task(gw.http.post("/v1/completions", json=BODY))
        submit = await gw.next_submit()
        await gw.reply(
            RequestDelta(
                request_id=submit.request_id, start_index=0, token_ids=[9], finish_reason="length"
            )
        )
        assert (await again).status_code == 200
