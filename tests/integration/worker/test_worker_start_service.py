"""The worker's start, in-process against a real Redis: its model resolves off the event loop,
so the worker answers /health while another process holds the model's conversion lock (a
first `docker compose up`: one service converts, the others wait), and serves once it is free."""

from __future__ import annotations

import asyncio
import fcntl
import threading
import time
from pathlib import Path

import httpx

from services.worker.service import WorkerService
from shared.bus import Bus
from shared.protocol import WorkerReady
from shared.service import bind_socket, serve
from shared.streams import Streams
from tests.integration.worker.service_support import next_message, tiny_worker_settings
from tests.support.tiny_gguf import make_tiny_gguf

#: How long the test holds the lock at most: a worker whose start blocked its event loop on the
#: lock answers only after this.
HOLD_S = 8.0


async def test_health_answers_while_the_model_waits_for_another_converter(
    tmp_path: Path, redis_url: str
) -> None:
    gguf, _ = make_tiny_gguf(tmp_path / "model", "qwen3")
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = open(cache / f".{gguf.stem}.lock", "w")  # noqa: SIM115 - released by the timer too
    fcntl.flock(lock, fcntl.LOCK_EX)
    released_at: list[float] = []

    def release() -> None:
        if not released_at:
            released_at.append(time.monotonic())
            fcntl.flock(lock, fcntl.LOCK_UN)

    valve = threading.Timer(HOLD_S, release)  # never left held, even by a blocked worker
    valve.start()
    settings = tiny_worker_settings(
        gguf, redis_url, "wstart", "w-start", model_cache_dir=str(cache),
        kv_cache_bytes=2**20, kv_offload=False,
    )  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    service, shutdown = WorkerService(settings), asyncio.Event()
    task = asyncio.create_task(serve(service, sock=sock, shutdown=shutdown))
    bus = Bus(redis_url, "test")
    await bus.connect()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            while True:  # the HTTP server comes up beside the start
                try:
                    health = await http.get("/health")
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
            answered_at = time.monotonic()
            ready = await http.get("/ready")
        assert health.status_code == 200
        # answered while the lock was held: not after the valve freed a blocked event loop
        assert not released_at, f"answered {answered_at - released_at[0]:.1f} s after the release"
        assert ready.status_code == 503 and ready.json()["checks"]["model"] == "loading"
        assert service.runner is None
        release()  # the other converter is done: this worker converts and serves
        announced = await next_message(bus, {Streams("wstart").control("0"): "0"}, WorkerReady)
        assert isinstance(announced, WorkerReady) and announced.model == "tiny"
        assert (cache / "qwen3-v1" / "config.json").exists()
    finally:
        valve.cancel()
        release()
        lock.close()
        shutdown.set()
        await task
        await bus.close()
