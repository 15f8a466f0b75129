"""The whole GatewayService under `serve()`: admin routes open, API behind keys, metrics after a
request, and a drain that refuses new work but finishes what is in flight."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.service import GatewayService
from shared.bus import Bus
from shared.config import GatewaySettings
from shared.protocol import RequestDelta, SubmitRequest, TokenDelta
from shared.service import bind_socket, serve
from shared.streams import Streams

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


class SchedulerSide:
    """The scheduler's end of the bus, driven by the test."""

    def __init__(self, bus: Bus, streams: Streams) -> None:
        self.bus = bus
        self.ids = {streams.requests: "0-0"}

    async def next_submit(self) -> SubmitRequest:
        async with asyncio.timeout(10):
            while not (got := await self.bus.read(self.ids, count=1, block_ms=200)):
                pass
        assert isinstance(got[0].message, SubmitRequest)
        return got[0].message

    async def finish(self, sub: SubmitRequest, ids: list[int]) -> None:
        delta = RequestDelta(
            request_id=sub.request_id,
            start_index=0,
            token_ids=ids,
            finish_reason="stop",
            stop_token_id=ids[-1],
        )
        await self.bus.publish(sub.reply_stream, TokenDelta(scheduler_id="s", deltas=[delta]))


@asynccontextmanager
async def running_gateway(
    redis_url: str, smollm2_dir: Path, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, SchedulerSide, asyncio.Task[int], asyncio.Event]]:
    options: dict[str, Any] = {
        "redis_url": redis_url,
        "model": str(smollm2_dir),
        "served_model_name": "smol",
        "api_keys": KEY,
        "admin_token": "admin",
        "instance_id": "gw-svc",
        "heartbeat_interval_s": 0.2,
        "log_json": False,
    }
    settings = GatewaySettings(**{**options, **overrides})
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(GatewayService(settings), sock=sock, shutdown=shutdown))
    bus = Bus(redis_url, consumer="scheduler-side")
    await bus.connect()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        try:
            await wait_ready(client)
            yield client, SchedulerSide(bus, Streams(settings.cluster)), task, shutdown
        finally:
            shutdown.set()
            await asyncio.wait_for(task, 30)
            await bus.close()


async def wait_ready(client: httpx.AsyncClient) -> dict[str, Any]:
    async with asyncio.timeout(60):
        while True:  # polls a condition; no timing is asserted
            try:
                resp = await client.get("/ready")
                if resp.status_code == 200:
                    return dict(resp.json())
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)


def sample(metrics: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{") and all(p in line for p in want.split(",")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_service_routes_auth_and_metrics(redis_url: str, smollm2_dir: Path) -> None:
    async with running_gateway(redis_url, smollm2_dir) as (client, scheduler, _task, _stop):
        assert (await client.get("/health")).status_code == 200  # open despite API keys
        ready = (await client.get("/ready")).json()
        assert ready["checks"]["model"] == "ok"
        assert (await client.get("/v1/models")).status_code == 401
        models = await client.get("/v1/models", headers=AUTH)
        assert models.json()["data"][0]["id"] == "smol"
        state = await client.get("/admin/state", headers={"Authorization": "Bearer admin"})
        assert state.json()["gateway"]["model"] == "smol"
        assert state.json()["config"]["api_keys"] == "***"

        before = (await client.get("/metrics")).text
        ids = [28120, 2]  # "hello" + eos
        req = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=AUTH))
        await scheduler.finish(await scheduler.next_submit(), ids)
        resp = await req
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "hello"
        after = (await client.get("/metrics")).text
        for name in (
            "meshllm:time_to_first_token_seconds_count",
            "meshllm:e2e_request_latency_seconds_count",
            "meshllm:request_prompt_tokens_count",
            "meshllm:request_generation_tokens_count",
        ):
            assert (
                sample(after, name, model_name="smol")
                == sample(before, name, model_name="smol") + 1
            )
        success = "meshllm:request_success_total"
        labels = {"model_name": "smol", "finished_reason": "stop"}
        assert sample(after, success, **labels) == sample(before, success, **labels) + 1
        assert sample(after, "meshllm:request_generation_tokens_sum", model_name="smol") == (
            sample(before, "meshllm:request_generation_tokens_sum", model_name="smol") + 2
        )


@pytest.mark.timeout(120)
async def test_drain_refuses_new_requests_and_finishes_in_flight(
    redis_url: str, smollm2_dir: Path
) -> None:
    async with running_gateway(redis_url, smollm2_dir) as (client, scheduler, task, shutdown):
        in_flight = asyncio.create_task(
            client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        )
        sub = await scheduler.next_submit()
        shutdown.set()
        async with asyncio.timeout(10):
            while (await client.get("/ready")).status_code != 503:  # until draining
                await asyncio.sleep(0.05)
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert not task.done()  # still waiting for the request in flight
        await scheduler.finish(sub, [28120, 2])
        assert (await in_flight).status_code == 200
        assert await asyncio.wait_for(task, 30) == 0


async def test_served_connections_have_tcp_nodelay() -> None:
    """Without TCP_NODELAY every keep-alive response (headers, then body) waits ~40 ms for a
    delayed ACK; asyncio sets it only on sockets created with proto IPPROTO_TCP."""
    sock = bind_socket("127.0.0.1", 0)
    accepted: asyncio.Queue[int] = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw = writer.get_extra_info("socket")
        accepted.put_nowait(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        _reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted.get(), 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
