"""A kvstore service run in-process (its admin app on a free port, its calls on the bus), and
a scheduler's rpc client to call it, for integration tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from services.kvstore.service import KVStoreService
from services.scheduler.offload.kvstore_client import KVStoreClient
from shared.bus import Bus
from shared.config import KVStoreSettings
from shared.kv.offload_key import KeySpace
from shared.rpc import RpcClient
from shared.service import bind_socket, serve
from shared.streams import Streams

CLUSTER = "kvt"
MODEL = "tiny-llama"
SPACE = KeySpace(CLUSTER, MODEL, 1)
NBYTES = 100
STREAMS = Streams(CLUSTER)


def settings(redis_url: str, capacity_chunks: int) -> KVStoreSettings:
    return KVStoreSettings(
        redis_url=redis_url,
        cluster=CLUSTER,
        instance_id="kv-it",
        heartbeat_interval_s=0.2,
        capacity_bytes=capacity_chunks * NBYTES,
    )


@dataclass
class RunningKVStore:
    service: KVStoreService
    http: httpx.AsyncClient  # its admin app
    rpc: RpcClient  # a scheduler's side of the calls

    def client(self, model: str = MODEL, timeout_s: float = 5.0) -> KVStoreClient:
        return KVStoreClient(self.rpc, STREAMS.calls("kvstore"), model, timeout_s=timeout_s)

    async def state(self) -> dict[str, Any]:
        return dict((await self.http.get("/admin/state")).json()["kvstore"])


@asynccontextmanager
async def scheduler_rpc(redis_url: str, instance: str = "sched-it") -> AsyncIterator[RpcClient]:
    """The rpc client a scheduler instance calls the kvstore with, on its own reply stream."""
    bus = Bus(redis_url, instance)
    await bus.connect()
    rpc = RpcClient(bus, STREAMS.rpc_replies("scheduler", instance), STREAMS.rpc_reply_prefix)
    await rpc.start()
    try:
        yield rpc
    finally:
        await rpc.stop()
        await bus.close()


@asynccontextmanager
async def kvstore(redis_url: str, capacity_chunks: int) -> AsyncIterator[RunningKVStore]:
    service = KVStoreService(settings(redis_url, capacity_chunks))
    sock = bind_socket("127.0.0.1", 0)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=sock, shutdown=shutdown))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with (
        httpx.AsyncClient(base_url=base, timeout=10) as http,
        scheduler_rpc(redis_url) as rpc,
    ):
        try:
            for _ in range(1000):
                try:
                    if (await http.get("/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("kvstore never became ready")
            yield RunningKVStore(service, http, rpc)
        finally:
            shutdown.set()
            assert await asyncio.wait_for(task, 30) == 0
