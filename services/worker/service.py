"""The worker service (model runner).

This is the service shell: it connects to Redis, serves its admin app, heartbeats and drains on
SIGTERM. No model is loaded here; the lead replaces `run()` with the runner loop (and readiness
then waits for the model and one real forward).
"""

from __future__ import annotations

from typing import Any

from shared.config import WorkerSettings
from shared.service import Service


class WorkerService(Service):
    name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        super().__init__(settings)
        self.settings: WorkerSettings = settings

    async def run(self) -> None:
        await self.stopping.wait()

    def state(self) -> dict[str, Any]:
        return {**super().state(), "role": "shell"}
