"""The kvstore service (KV offload tier: block metadata, LRU policy, pins).

This is the service shell: it connects to Redis, serves its admin app, heartbeats and drains on
SIGTERM. The offload policy (CONTRACTS.md, KV offload tier) and its bus handlers come with the
KV offload issue.
"""

from __future__ import annotations

from typing import Any

from shared.config import KVStoreSettings
from shared.service import Service


class KVStoreService(Service):
    name = "kvstore"

    def __init__(self, settings: KVStoreSettings) -> None:
        super().__init__(settings)
        self.settings: KVStoreSettings = settings

    async def run(self) -> None:
        await self.stopping.wait()

    def state(self) -> dict[str, Any]:
        return {**super().state(), "role": "shell"}
