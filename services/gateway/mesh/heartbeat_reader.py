"""The heartbeat stream's edge of the gateway's MeshView: a fan-out reader (plain XREAD, every
gateway reads every beat) that feeds each beat to the view.

It starts from the stream's recent history, not from "$": stream ids are Redis' millisecond
clock, so reading from `now - history_s` replays the recent beats and a restarted gateway knows
the mesh from its first read instead of one beat interval later (the view judges each replayed
beat by its own time, so a longer history only adds information). Malformed entries are
dead-lettered by the bus and reading goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from services.gateway.mesh.groups import ALIVE_INTERVALS, MeshView, Serving
from shared.bus import Bus
from shared.protocol import Heartbeat

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
MIN_HISTORY_S = 30.0
"""Replayed at least: the alive window of schedulers beating up to 10 s apart."""


def history_for(interval_s: float) -> float:
    """The history a gateway beating every `interval_s` replays: three intervals (the alive
    window of beats like its own), or MIN_HISTORY_S when longer."""
    return max(ALIVE_INTERVALS * interval_s, MIN_HISTORY_S)


def history_start_id(now: float, history_s: float) -> str:
    """The stream id from which entries of the last `history_s` seconds are read."""
    return f"{max(0, int((now - history_s) * 1000))}-0"


class HeartbeatReader:
    def __init__(self, bus: Bus, stream: str, view: MeshView, *, history_s: float) -> None:
        self.bus = bus
        self.stream = stream
        self.view = view
        self.history_s = history_s
        self.beats_read = 0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        last_ids = {self.stream: history_start_id(time.time(), self.history_s)}
        self._task = asyncio.create_task(self._read(last_ids), name="gateway-heartbeats")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_for(self, predicate: Callable[[MeshView], bool]) -> None:
        """Until `predicate(view)` holds, checked after each batch of beats read (callers bound
        it with a timeout). Lets a caller wait for a mesh state without polling."""
        async with self._changed:
            await self._changed.wait_for(lambda: predicate(self.view))

    async def serving(self, model: str) -> Serving:
        """The view's answer for `model` now, except that a group which has only just lapsed
        (MeshView.grace_s) is given one beat interval for its next beat to be read: a late
        reading, or a beat held up on a loaded host, is not a dead group."""
        serving = self.view.serving(model, time.time())
        grace_s = 0.0 if serving.ok else self.view.grace_s(model, time.time())
        if grace_s > 0:
            started = time.monotonic()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await self.wait_for(lambda v: v.serving(model, time.time()).ok)
            serving = self.view.serving(model, time.time())
            # Each one is worth an operator's look: beats this late are a loaded host, a
            # blocked event loop, or the start of a real outage.
            log.warning(
                "worker groups for %r fell out of their alive window; after %.2f s: %s",
                model,
                time.monotonic() - started,
                "heard again" if serving.ok else serving.reason,
            )
        return serving

    async def _read(self, last_ids: dict[str, str]) -> None:
        """Runs for the gateway's life. The bus retries through Redis outages itself; anything
        else is logged and reading goes on: a gateway that stopped reading beats would refuse
        every request once the last ones it saw expired."""
        while True:
            try:
                deliveries = await self.bus.read(last_ids, count=256, block_ms=READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading the heartbeat stream failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                if isinstance(delivery.message, Heartbeat):
                    self.view.observe(delivery.message)
                    self.beats_read += 1
                else:
                    log.warning("unexpected %s on the heartbeat stream", delivery.message.TYPE)
            async with self._changed:
                self._changed.notify_all()
