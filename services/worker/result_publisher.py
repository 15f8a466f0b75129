"""StepResults published in step order by one task, off the step's critical path.

Publishing a result is a Redis round trip. Awaited where the step ends, it sits between that
step and the next one: the next plan (already read, with asynchronous scheduling) waits for it,
and on CPU the idle torch threads spin meanwhile. Queued here instead, the next step starts on
the step thread at once and the result goes out while it runs. One task, one queue: results
still leave in the order they were queued, which is step order.

A publish that fails (the bus gave up retrying) ends the task; the next `put` or `flush`
raises its error, so the worker fails as it did when it awaited the publish itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from shared.protocol import StepResult


class ResultPublisher:
    def __init__(self, publish: Callable[[StepResult], Awaitable[None]]) -> None:
        self._publish = publish
        self._queue: asyncio.Queue[StepResult] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def put(self, result: StepResult) -> None:
        self._check()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="result-publisher")
        self._queue.put_nowait(result)

    async def flush(self) -> None:
        """Return once every queued result is out (or raise why it cannot be)."""
        if self._task is None:
            return
        joined = asyncio.ensure_future(self._queue.join())
        try:
            await asyncio.wait([joined, self._task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            joined.cancel()
        self._check()

    async def close(self) -> None:
        """Flush, then stop the task."""
        try:
            await self.flush()
        finally:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._task
                self._task = None

    def _check(self) -> None:
        task = self._task
        if task is not None and task.done() and not task.cancelled():
            error = task.exception()
            raise RuntimeError("publishing step results failed") from error

    async def _run(self) -> None:
        while True:
            result = await self._queue.get()
            try:
                await self._publish(result)
            finally:
                self._queue.task_done()
