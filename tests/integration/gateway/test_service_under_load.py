"""The GatewayService under `serve()` with work that used to stall or cut it: a 10 MB prompt
being tokenized while /health must answer, and requests still in flight when the drain's time
is up."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.integration.gateway.test_service import AUTH, CHAT, running_gateway

PLANNING = "meshllm:gateway_requests_planning"


async def planning(client: httpx.AsyncClient) -> float:
    metrics = (await client.get("/metrics")).text
    line = next(x for x in metrics.splitlines() if x.startswith(PLANNING + " "))
    return float(line.split()[1])


@pytest.mark.timeout(300)
async def test_health_answers_while_a_10mb_prompt_is_tokenized(
    redis_url: str, smollm2_dir: Path
) -> None:
    """Ordering, not timing: /health is answered between two moments at which the gateway
    reports the big request still being planned."""
    async with running_gateway(redis_url, smollm2_dir) as (client, _scheduler, _task, _stop):
        prompt = ("The quick brown fox jumps over the lazy dog. " * 230_000)[:10_000_000]
        body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
        headers = {**AUTH, "content-type": "application/json"}
        big = asyncio.create_task(
            client.post("/v1/completions", content=body, headers=headers, timeout=280)
        )
        async with asyncio.timeout(120):
            while await planning(client) < 1:
                assert not big.done(), big.result().text
                await asyncio.sleep(0.01)
        answered = False
        while not answered and not big.done():
            before = await planning(client)
            health = await client.get("/health")
            after = await planning(client)
            answered = before >= 1 and after >= 1 and health.status_code == 200
        assert answered, "/health was not answered while the prompt was being planned"
        resp = await big
        assert resp.status_code == 400, resp.text
        assert "maximum context length" in resp.json()["error"]["message"]
        assert resp.json()["error"]["param"] == "prompt"
        assert await planning(client) == 0


@pytest.mark.timeout(120)
async def test_requests_still_in_flight_when_the_drain_times_out_end_with_a_503(
    redis_url: str, smollm2_dir: Path
) -> None:
    """No scheduler answers: at shutdown the drain (1 s here) runs out, and each client gets an
    error it can read: the stream an error event and [DONE], the plain request a 503 body."""
    async with running_gateway(redis_url, smollm2_dir, shutdown_timeout_s=1.0) as (
        client,
        scheduler,
        task,
        shutdown,
    ):
        events: list[str] = []

        async def stream() -> None:
            body = {**CHAT, "stream": True}
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=AUTH, timeout=60
            ) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))

        streaming = asyncio.create_task(stream())
        plain = asyncio.create_task(
            client.post("/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60)
        )
        await scheduler.next_submit()
        await scheduler.next_submit()  # both are in flight
        shutdown.set()
        resp = await plain
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["type"] == "service_unavailable"
        assert resp.json()["error"]["code"] == "shutting_down"
        await streaming
        assert events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and error["type"] == "service_unavailable"
        assert await asyncio.wait_for(task, 30) == 0
