"""The whole GatewayService under `serve()`: admin routes open, API behind keys, metrics after a
request, a drain that refuses new work but finishes what is in flight, and readiness learned
from the heartbeat stream: not ready, and generation refused with 503 + Retry-After, while no
scheduler with a ready worker group beats for the served model."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.api_processes import ApiProcess
from services.gateway.service import GatewayService
from shared.bus import Bus
from shared.config import GatewaySettings
from shared.heartbeat import Heartbeater
from shared.protocol import RequestDelta, SubmitRequest, TokenDelta
from shared.service import bind_socket, serve
from shared.streams import Streams
from tests.support.stream_counts import entries_added_async

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


class SchedulerSide:
    """The scheduler's end of the bus, driven by the test. Its heartbeats go out through the
    real Heartbeater and say what `ready` says (a scheduler whose worker group is up, or not)."""

    def __init__(self, bus: Bus, streams: Streams, *, ready: bool, interval_s: float) -> None:
        self.bus = bus
        self.ids = {streams.requests: "0-0"}
        self.ready = ready
        self.beats = Heartbeater(
            bus,
            streams.heartbeats,
            service="scheduler",
            instance_id="sched-0",
            group="0",
            interval_s=interval_s,
            is_ready=self.is_ready,
            model="smol",
            role="both",
        )

    async def is_ready(self) -> bool:
        return self.ready

    async def next_submit(self) -> SubmitRequest:
        # A bound on a wait, not a speed claim: it returns as soon as the request arrives. 10 s
        # was passed once in a `-n 4` run beside other load (the gateway's first request).
        async with asyncio.timeout(30):
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
    redis_url: str,
    smollm2_dir: Path,
    *,
    scheduler_ready: bool = True,
    api_process: ApiProcess | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, SchedulerSide, asyncio.Task[int], asyncio.Event]]:
    """The gateway under serve(), and the scheduler's side beating (ready or not) from before
    the gateway starts; yields once the gateway's model is loaded (ready, when the scheduler
    side says so). `overrides` change the gateway's settings."""
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
    bus = Bus(redis_url, consumer="scheduler-side")
    await bus.connect()
    scheduler = SchedulerSide(bus, Streams(settings.cluster), ready=scheduler_ready, interval_s=0.2)
    stop_beats = asyncio.Event()
    beats = asyncio.create_task(scheduler.beats.run(stop_beats))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    shutdown = asyncio.Event()
    service = GatewayService(settings, api_process)
    task = asyncio.create_task(serve(service, sock=sock, shutdown=shutdown))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        try:
            if api_process is not None:  # its own checks pass; its siblings' are the test's
                await wait_ready(client, loaded_and_serving)
            elif scheduler_ready:
                await wait_ready(client)
            else:
                await wait_ready(client, loaded_and_sees_the_scheduler)
            yield client, scheduler, task, shutdown
        finally:
            shutdown.set()
            await asyncio.wait_for(task, 30)
            stop_beats.set()
            await beats
            await bus.close()


def _is_200(resp: httpx.Response) -> bool:
    return resp.status_code == 200


def loaded_and_serving(resp: httpx.Response) -> bool:
    checks = resp.json()["checks"]
    return checks.get("model") == "ok" and checks.get("workers") == "ok"


def loaded_and_sees_the_scheduler(resp: httpx.Response) -> bool:
    checks = resp.json()["checks"]
    return checks.get("model") == "ok" and "1 scheduler alive" in checks.get("workers", "")


async def wait_ready(
    client: httpx.AsyncClient, until: Callable[[httpx.Response], bool] = _is_200
) -> dict[str, Any]:
    """The /ready body once `until` holds for its response."""
    async with asyncio.timeout(60):
        while True:  # polls a condition; no timing is asserted
            try:
                resp = await client.get("/ready")
                if until(resp):
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
        assert ready["checks"]["model"] == "ok" and ready["checks"]["workers"] == "ok"
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


@pytest.mark.timeout(120)
async def test_not_ready_and_refusing_generation_until_a_worker_group_is_ready(
    redis_url: str, smollm2_dir: Path
) -> None:
    async with running_gateway(redis_url, smollm2_dir, scheduler_ready=False) as (
        client,
        scheduler,
        _task,
        _stop,
    ):
        # A scheduler beats, but its worker group is not ready: the gateway cannot serve.
        resp = await client.get("/ready")
        assert resp.status_code == 503
        checks = resp.json()["checks"]
        assert checks["model"] == "ok" and checks["redis"] == "ok"
        assert checks["workers"] == (
            "no ready worker group for model 'smol' (1 scheduler alive, none ready)"
        )

        refused = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable"
        assert "no ready worker group for model 'smol'" in error["message"]
        completion = {"prompt": "Hi", "max_tokens": 3}
        refused = await client.post("/v1/completions", json=completion, headers=AUTH)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        # A client's own mistake is reported first, mesh or no mesh.
        bad = await client.post("/v1/chat/completions", json={"messages": []}, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        # What needs no worker group keeps working.
        assert (await client.get("/v1/models", headers=AUTH)).status_code == 200
        tokens = await client.post("/tokenize", json={"prompt": "hello"}, headers=AUTH)
        assert tokens.status_code == 200 and tokens.json()["count"] >= 1
        ids = tokens.json()["tokens"]
        text = await client.post("/detokenize", json={"tokens": ids}, headers=AUTH)
        assert text.status_code == 200 and "hello" in text.json()["prompt"]
        assert await entries_added_async(scheduler.bus.redis, Streams().requests) == 0

        # The worker group comes up: ready, and a request is served.
        scheduler.ready = True
        body = await wait_ready(client)
        assert body["checks"]["workers"] == "ok"
        state = await client.get("/admin/state", headers={"Authorization": "Bearer admin"})
        (record,) = state.json()["mesh"]["schedulers"]
        assert record["instance_id"] == "sched-0" and record["ready"] is True
        req = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=AUTH))
        await scheduler.finish(await scheduler.next_submit(), [28120, 2])
        assert (await req).status_code == 200

        # It goes away (its scheduler says not ready): refused again.
        scheduler.ready = False
        await wait_ready(client, lambda r: r.status_code == 503)
        again = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert again.status_code == 503


@pytest.mark.timeout(120)
async def test_a_restarted_gateway_learns_the_mesh_from_the_stream_history(
    redis_url: str, smollm2_dir: Path
) -> None:
    """One ready beat, published before the gateway starts, from a scheduler that beats every
    30 s: the gateway is ready without waiting for the next beat, because it reads the recent
    history of the heartbeat stream instead of starting at its end."""
    bus = Bus(redis_url, consumer="scheduler-side")
    await bus.connect()
    scheduler = SchedulerSide(bus, Streams(), ready=True, interval_s=30.0)
    await scheduler.beats.beat()
    settings = GatewaySettings(
        redis_url=redis_url,
        model=str(smollm2_dir),
        served_model_name="smol",
        instance_id="gw-restarted",
        heartbeat_interval_s=0.2,
        log_json=False,
    )
    sock = bind_socket("127.0.0.1", 0)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(GatewayService(settings), sock=sock, shutdown=shutdown))
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
            body = await wait_ready(client)
        assert body["checks"]["workers"] == "ok"
        assert scheduler.beats.sent == 1  # no beat since the gateway started
    finally:
        shutdown.set()
        await asyncio.wait_for(task, 30)
        await bus.close()


async def test_an_api_process_is_ready_only_once_its_siblings_have_started(
    redis_url: str, smollm2_dir: Path
) -> None:
    """MESHLLM_API_PROCESSES: the port answers ready only when every process behind it would
    serve. Here this process is API process 0 of 2 and its sibling's flag is not set yet."""
    parent = subprocess.Popen(["sleep", "60"])  # stands in for the parent (gets the drain)
    place = ApiProcess(0, 2, parent.pid, started=[0, 0])
    try:
        async with running_gateway(redis_url, smollm2_dir, api_process=place) as (client, *_):
            resp = await client.get("/ready")
            assert resp.status_code == 503
            assert resp.json()["checks"]["api_processes"] == "1 of 2"  # itself only
            place.started[1] = 1
            ready = await wait_ready(client)
            assert ready["checks"]["api_processes"] == "ok"
            state = await client.get("/admin/state", headers={"Authorization": "Bearer admin"})
            assert state.json()["api_process"] == {"index": 0, "count": 2, "pid": os.getpid()}
        # Its drain at shutdown asked the parent to drain the siblings too (SIGUSR2).
        assert parent.wait(10) == -signal.SIGUSR2
    finally:
        parent.kill()
