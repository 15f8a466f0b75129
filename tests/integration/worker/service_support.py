"""What the in-process worker service tests share: a tiny CPU worker's settings, a prompt for
it, and a wait for the next message of a kind on the bus."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from shared.bus import Bus
from shared.config import WorkerSettings
from shared.protocol import Message

PROMPT = [1, 17, 99, 4, 250, 31, 8, 77, 300, 12, 5, 40, 61]  # token ids of the tiny Llama


async def next_message(bus: Bus, last: dict[str, str], kind: type[Message]) -> Message:
    async with asyncio.timeout(60):
        while True:
            for delivery in await bus.read(last, block_ms=1000):
                if isinstance(delivery.message, kind):
                    return delivery.message


def tiny_worker_settings(
    model: Path, redis_url: str, cluster: str, instance_id: str, **overrides: Any
) -> WorkerSettings:
    """A CPU worker of the tiny Llama at `model` with a 40-block fp32 cache."""
    settings: dict[str, Any] = {
        "redis_url": redis_url,
        "cluster": cluster,
        "instance_id": instance_id,
        "model": str(model),
        "served_model_name": "tiny",
        "dtype": "float32",
        "device": "cpu",
        "block_size": 4,
        "max_model_len": 64,
        "kv_cache_bytes": 40 * 3 * 2 * 4 * 2 * 16 * 4,  # 40 blocks
        "num_threads": 1,
        "heartbeat_interval_s": 0.2,
    }
    return WorkerSettings(**{**settings, **overrides})
