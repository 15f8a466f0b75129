"""Submissions leave for Redis in shared pipelines: every request admitted while a pipeline is
on its way (or in the same event-loop turn as the first) goes out in the next one.

A burst of requests (a benchmark's 64 at once, a client's retry storm) was one pipeline, one
socket write and one reply read per request, all on the gateway's single event loop, so the
last request of a burst reached its scheduler a whole burst of round trips after the first.
Batched like Nagle's algorithm, an idle gateway still sends a lone request at once, and under a
burst each request waits at most one round trip for the pipeline before its own.

What each caller gets is what `Bus.publish_many` would have given it alone: its entry ids, or
its own PublishRefused when Redis refused one of its entries (another caller's refused entry is
not its failure), or the batch's error when Redis could not be reached at all.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import ResponseError

from shared.bus import Bus, PublishRefused
from shared.protocol import Message

Items = list[tuple[str, Message]]


class SubmitBatcher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.pipelines = 0  # sent so far (a test's and an operator's view of the batching)
        self._pending: list[tuple[Items, asyncio.Future[list[str]]]] = []
        self._sender: asyncio.Task[None] | None = None

    async def publish(self, items: Items) -> list[str]:
        """Publish `items` with whatever else is waiting; their entry ids, in order."""
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self._pending.append((items, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send(), name="gateway-submits")
        return await future

    async def close(self) -> None:
        """Wait for what was handed over to be sent (or to fail)."""
        if self._sender is not None and not self._sender.done():
            await asyncio.wait([self._sender])

    async def _send(self) -> None:
        # Started as a task, this runs after the rest of the loop turn that made it: the
        # admissions of that turn are already waiting.
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                await self._send_batch(batch)
        finally:  # cancelled (the loop is closing): no caller is left waiting for good
            leftover, self._pending = self._pending, []
            for _items, future in leftover:
                if not future.done():
                    future.set_exception(ConnectionError("the gateway is stopping"))

    async def _send_batch(self, batch: list[tuple[Items, asyncio.Future[list[str]]]]) -> None:
        flat = [item for items, _ in batch for item in items]
        self.pipelines += 1
        try:
            ids: list[str | None] = list(await self.bus.publish_many(flat))
            errors: dict[int, ResponseError] = {}
        except PublishRefused as exc:
            ids, errors = exc.ids, dict(exc.errors)
        except BaseException as exc:  # unreachable Redis (or cancelled): every caller's error
            for _items, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else ConnectionError())
            if not isinstance(exc, Exception):
                raise
            return
        start = 0
        for items, future in batch:
            end = start + len(items)
            own = {i - start: e for i, e in errors.items() if start <= i < end}
            if not future.done():
                if own:
                    future.set_exception(PublishRefused(ids[start:end], own))
                else:
                    future.set_result([i for i in ids[start:end] if i is not None])
            start = end
