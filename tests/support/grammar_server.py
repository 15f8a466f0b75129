"""A real grammar service running in the test's event loop, on a free loopback port.

For tests of the grammar service itself and of its clients (the gateway): the real
GrammarService (tokenizer, compiler processes, Redis cache) served by the real `serve()`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.grammar.service import GrammarService
from shared.config import GrammarSettings
from shared.service import bind_socket, serve

READY_TIMEOUT_S = 300.0  # the first start loads the tokenizer and forks compilers: slow on CI


@dataclass
class RunningGrammarService:
    service: GrammarService
    url: str
    http: httpx.AsyncClient

    async def compile(self, kind: str, spec: str = "") -> httpx.Response:
        return await self.http.post("/v1/grammars/compile", json={"kind": kind, "spec": spec})


@contextlib.asynccontextmanager
async def grammar_service(
    redis_url: str, model_dir: Path, **overrides: Any
) -> AsyncIterator[RunningGrammarService]:
    options: dict[str, Any] = {
        "redis_url": redis_url,
        "model": str(model_dir),
        "instance_id": "grammar-test",
        "heartbeat_interval_s": 0.2,
        "log_json": False,
    }
    options.update(overrides)
    service = GrammarService(GrammarSettings(**options))
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=sock, shutdown=shutdown))
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                while not await _ready(http):
                    if task.done():
                        raise RuntimeError(f"grammar service exited with {task.result()}")
                    await asyncio.sleep(0.05)
            yield RunningGrammarService(service, url, http)
        finally:
            shutdown.set()
            await asyncio.wait_for(task, 60)


async def _ready(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/ready")).status_code == 200
    except httpx.TransportError:  # uvicorn not listening yet
        return False
