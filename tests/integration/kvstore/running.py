"""A kvstore service run in-process on a free port, for integration tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from services.kvstore.service import KVStoreService
from shared.config import KVStoreSettings
from shared.kv.offload_key import KeySpace
from shared.service import bind_socket, serve

CLUSTER = "kvt"
MODEL = "tiny-llama"
SPACE = KeySpace(CLUSTER, MODEL, 1)
NBYTES = 100


def settings(redis_url: str, capacity_chunks: int) -> KVStoreSettings:
    return KVStoreSettings(
        redis_url=redis_url,
        cluster=CLUSTER,
        instance_id="kv-it",
        heartbeat_interval_s=0.2,
        capacity_bytes=capacity_chunks * NBYTES,
    )


@asynccontextmanager
async def kvstore(redis_url: str, capacity_chunks: int) -> AsyncIterator[httpx.AsyncClient]:
    service = KVStoreService(settings(redis_url, capacity_chunks))
    sock = bind_socket("127.0.0.1", 0)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=sock, shutdown=shutdown))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        try:
            for _ in range(1000):
                try:
                    if (await client.get("/ready")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("kvstore never became ready")
            yield client
        finally:
            shutdown.set()
            assert await asyncio.wait_for(task, 30) == 0
