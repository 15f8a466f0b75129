"""The scheduler service (engine core: queues, block manager, step loop).

This is the service shell: it connects to Redis, serves its admin app, heartbeats and drains on
SIGTERM. The lead replaces `run()` with the step loop built on the scheduler's core objects.
"""

from __future__ import annotations

from typing import Any

from shared.config import SchedulerSettings
from shared.service import Service


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, settings: SchedulerSettings) -> None:
        super().__init__(settings)
        self.settings: SchedulerSettings = settings

    async def run(self) -> None:
        await self.stopping.wait()

    def state(self) -> dict[str, Any]:
        return {**super().state(), "role": "shell"}
