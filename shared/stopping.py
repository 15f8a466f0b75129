"""Racing a call against what makes it moot: a service's stop, a client gone.

A bus call waits out a Redis outage (shared.bus_retry). A loop that makes one until its service
stops would, with Redis gone for good (a stack torn down at once), hold the service's exit
until the drain's timeout: `unless_stopped` races the call against the stop instead. The
gateway races a non-streamed generation against its client's disconnect the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def result_or_none(work: Awaitable[T], rival: Awaitable[object]) -> T | None:
    """`work`'s result; None, with `work` cancelled, when `rival` completes first. `rival` is
    cancelled once `work` is done; a failure of `work` is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(rival)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def unless_stopped(call: Awaitable[T], stopping: asyncio.Event) -> T | None:
    """`call`'s result; None, with `call` cancelled, when `stopping` is set first.

    Only for calls that are safe to cancel: a consumer-group read whose reply is lost leaves
    its entries pending for a claim, a plain read has not moved its cursor."""
    return await result_or_none(call, stopping.wait())
