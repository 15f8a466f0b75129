"""The grammar service (structured-output grammar compilation and cache).

This is the service shell: it connects to Redis, serves its admin app, heartbeats and drains on
SIGTERM. Compilation (xgrammar) and the cache under `meshllm:<cluster>:grammar:*` come with
the structured-outputs issue.
"""

from __future__ import annotations

from typing import Any

from shared.config import GrammarSettings
from shared.service import Service


class GrammarService(Service):
    name = "grammar"

    def __init__(self, settings: GrammarSettings) -> None:
        super().__init__(settings)
        self.settings: GrammarSettings = settings

    async def run(self) -> None:
        await self.stopping.wait()

    def state(self) -> dict[str, Any]:
        return {**super().state(), "role": "shell"}
