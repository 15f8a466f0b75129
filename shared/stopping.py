"""Waiting on Redis without holding up a stop.

A bus call waits out a Redis outage (shared.bus_retry). A loop that makes one until its service
stops would, with Redis gone for good (a stack torn down all at once), hold the service's exit
until the drain's timeout. `unless_stopped` races the call against the stop instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def unless_stopped(call: Awaitable[T], stopping: asyncio.Event) -> T | None:
    """`call`'s result; None, with `call` cancelled, when `stopping` is set first.

    Only for calls that are safe to cancel: a consumer-group read whose reply is lost leaves
    its entries pending for a claim, a plain read has not moved its cursor."""
    work = asyncio.ensure_future(call)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    return None if work.cancelled() else work.result()
