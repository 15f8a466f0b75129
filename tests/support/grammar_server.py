"""A real grammar service running in the test's event loop: its admin app on a free loopback
port, its calls on the bus.

For tests of the grammar service itself and of its clients (the gateway): the real
GrammarService (tokenizer, compiler processes, Redis cache) served by the real `serve()`, and
a real rpc client (as a gateway instance has) to call it.
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
from shared.bus import Bus
from shared.config import GrammarSettings
from shared.protocol import CompileGrammar, GrammarCompiled
from shared.rpc import RpcClient
from shared.service import bind_socket, serve
from shared.streams import Streams

READY_TIMEOUT_S = 300.0  # the first start loads the tokenizer and forks compilers: slow on CI


@dataclass
class RunningGrammarService:
    service: GrammarService
    url: str
    http: httpx.AsyncClient  # its admin app
    rpc: RpcClient  # a gateway's side of the calls
    stream: str  # its calls stream

    async def compile(self, kind: str, spec: str = "", timeout_s: float = 60) -> GrammarCompiled:
        """The service's answer; RpcError when it refuses the spec."""
        request = CompileGrammar(kind=kind, spec=spec)  # type: ignore[arg-type]
        return await self.rpc.call(self.stream, request, GrammarCompiled, timeout_s)


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
    settings = GrammarSettings(**options)
    streams = Streams(settings.cluster)
    service = GrammarService(settings)
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=sock, shutdown=shutdown))
    bus = Bus(redis_url, "gateway-test")
    await bus.connect()
    rpc = RpcClient(
        bus, streams.rpc_replies("gateway", "gw-grammar-test"), streams.rpc_reply_prefix
    )
    await rpc.start()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                while not await _ready(http):
                    if task.done():
                        raise RuntimeError(f"grammar service exited with {task.result()}")
                    await asyncio.sleep(0.05)
            yield RunningGrammarService(service, url, http, rpc, streams.calls("grammar"))
        finally:
            shutdown.set()
            await asyncio.wait_for(task, 60)
            await rpc.stop()
            await bus.close()


async def _ready(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/ready")).status_code == 200
    except httpx.TransportError:  # uvicorn not listening yet
        return False
