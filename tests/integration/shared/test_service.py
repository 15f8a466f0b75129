"""`serve()` in-process against a real Redis: readiness, heartbeats, drain order, failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from shared.codec import decode
from shared.config import KVStoreSettings, SchedulerSettings
from shared.protocol import Heartbeat
from shared.service import Service, bind_socket, serve
from shared.streams import Streams


class Recorder(Service):
    """A real Service whose hooks record the order they ran in; behaviour set per test."""

    name = "kvstore"

    def __init__(self, settings: KVStoreSettings, *, run_mode: str = "wait", drain_s: float = 0):
        super().__init__(settings)
        self.events: list[str] = []
        self.run_mode = run_mode
        self.drain_s = drain_s
        self.running = asyncio.Event()

    async def run(self) -> None:
        self.events.append("run")
        self.running.set()
        if self.run_mode == "fail":
            raise RuntimeError("loop crashed")
        if self.run_mode == "return":
            return
        await self.stopping.wait()
        self.events.append("run-returned")

    async def drain(self) -> None:
        self.events.append("drain")
        await asyncio.sleep(self.drain_s)  # in-flight work that takes this long
        self.events.append("drained")

    async def close(self) -> None:
        self.events.append("close")
        await super().close()

    def state(self) -> dict[str, Any]:
        return {**super().state(), "events": list(self.events)}


def settings(redis_url: str, **kw: Any) -> KVStoreSettings:
    return KVStoreSettings(
        redis_url=redis_url, cluster="svc", heartbeat_interval_s=0.05, instance_id="kv-1", **kw
    )


@asynccontextmanager
async def running(service: Service) -> AsyncIterator[tuple[httpx.AsyncClient, asyncio.Task[int]]]:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=sock, shutdown=shutdown))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        try:
            yield client, task
        finally:
            shutdown.set()
            await asyncio.wait_for(task, 30)


async def wait_ready(client: httpx.AsyncClient, want: int = 200) -> dict[str, Any]:
    for _ in range(500):
        try:
            resp = await client.get("/ready")
            if resp.status_code == want:
                return dict(resp.json())
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.01)
    raise AssertionError(f"/ready never answered {want}")


async def test_ready_heartbeats_and_orderly_shutdown(redis_url: str) -> None:
    service = Recorder(settings(redis_url))
    async with running(service) as (client, task):
        body = await wait_ready(client)
        assert body["checks"] == {"service": "ok", "redis": "ok"}
        await service.running.wait()
        r = aioredis.Redis.from_url(redis_url)
        stream = Streams("svc").heartbeats
        for _ in range(500):
            entries = await r.xrange(stream)
            if len(entries) >= 2:
                break
            await asyncio.sleep(0.01)
        beats = [decode(fields[b"m"], Heartbeat) for _, fields in entries]
        await r.aclose()
        assert len(beats) >= 2
        assert {b.incarnation for b in beats} == {service.incarnation}
        assert all(b.service == "kvstore" and b.instance_id == "kv-1" for b in beats)
        assert beats[-1].ready is True
    assert task.result() == 0
    # stopping is set first (the loop and the drain then run concurrently); the bus is closed
    # only after both the drain and the loop finished.
    assert sorted(service.events) == sorted(["run", "drain", "run-returned", "drained", "close"])
    assert service.events[-1] == "close"


class SchedulerShell(Service):
    """A service with a scheduler's settings and nothing else: what its beats announce."""

    name = "scheduler"

    async def run(self) -> None:
        await self.stopping.wait()


async def test_beats_announce_the_model_role_and_interval(redis_url: str) -> None:
    scheduler_settings = SchedulerSettings(
        redis_url=redis_url,
        cluster="svc",
        instance_id="sched-1",
        heartbeat_interval_s=0.05,
        model="/models/tiny-llama",
        role="prefill",
    )
    want = {("scheduler", "tiny-llama", "prefill", 0.05), ("kvstore", "", "", 0.05)}
    kvstore = Recorder(settings(redis_url))
    async with running(SchedulerShell(scheduler_settings)), running(kvstore):
        r = aioredis.Redis.from_url(redis_url)
        for _ in range(500):  # polls a condition; no timing is asserted
            entries = await r.xrange(Streams("svc").heartbeats)
            beats = [decode(fields[b"m"], Heartbeat) for _, fields in entries]
            if want <= {(b.service, b.model, b.role, b.interval_s) for b in beats}:
                break
            await asyncio.sleep(0.01)
        await r.aclose()
    assert want <= {(b.service, b.model, b.role, b.interval_s) for b in beats}


async def test_run_failure_exits_1_and_still_drains(redis_url: str) -> None:
    service = Recorder(settings(redis_url), run_mode="fail")
    sock = bind_socket("127.0.0.1", 0)
    status = await asyncio.wait_for(serve(service, sock=sock), 30)
    assert status == 1
    assert service.events == ["run", "drain", "drained", "close"]


async def test_run_returning_on_its_own_is_a_failure(redis_url: str) -> None:
    service = Recorder(settings(redis_url), run_mode="return")
    status = await asyncio.wait_for(serve(service, sock=bind_socket("127.0.0.1", 0)), 30)
    assert status == 1


async def test_drain_is_bounded_by_shutdown_timeout(redis_url: str) -> None:
    service = Recorder(settings(redis_url, shutdown_timeout_s=0.2), drain_s=60)
    async with running(service) as (client, task):
        await wait_ready(client)
    assert task.result() == 0
    assert "drain" in service.events and "drained" not in service.events
    assert service.events[-1] == "close"


async def test_drain_action_keeps_serving_until_shutdown(redis_url: str) -> None:
    service = Recorder(settings(redis_url, admin_token="t"))
    async with running(service) as (client, task):
        await wait_ready(client)
        resp = await client.post("/admin/actions/drain", headers={"Authorization": "Bearer t"})
        assert resp.json()["result"]["drained"] is True
        body = await wait_ready(client, want=503)
        assert body["checks"]["service"] == "draining"
        state = (await client.get("/admin/state", headers={"Authorization": "Bearer t"})).json()
        assert state["stopping"] is True
        assert not task.done()  # the admin app is still up after the loop returned
    assert task.result() == 0
    assert service.events.count("drain") == 1  # the signal path reused the finished drain


class BrokenSetup(Recorder):
    async def start(self) -> None:
        await super().start()
        raise RuntimeError("own set-up failed")


async def test_start_failure_exits_1_without_running(redis_url: str) -> None:
    service = BrokenSetup(settings(redis_url))
    status = await asyncio.wait_for(serve(service, sock=bind_socket("127.0.0.1", 0)), 30)
    assert status == 1
    assert "run" not in service.events
    assert service.events[-1] == "close"  # the connected bus is still closed


async def test_port_clash_is_a_clear_error() -> None:
    first = bind_socket("127.0.0.1", 0)
    first.listen()
    port = first.getsockname()[1]
    with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
        bind_socket("127.0.0.1", port)
    first.close()
