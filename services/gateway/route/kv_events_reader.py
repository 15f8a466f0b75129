"""The kvevents stream's edge of the router's KV index: a fan-out reader (plain XREAD, every
gateway reads every group's events) applying each KVEvents to the index.

Like the heartbeat reader it starts from the stream's recent history (`history_s` back, by the
ids' millisecond clock): a restarted gateway replays the groups' last snapshots and the batches
after them, so it routes by cache again from its first read. Schedulers snapshot every
`kv_snapshot_interval_s` (10 s by default, less than the history), so the replay always holds
one. Malformed entries are dead-lettered by the bus; an event the index refuses is logged and
reading goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.gateway.mesh.heartbeat_reader import history_start_id
from services.gateway.route.kv_index import KVIndex
from shared.bus import Bus
from shared.protocol import KVEvents

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
HISTORY_S = 30.0


class KVEventsReader:
    def __init__(self, bus: Bus, stream: str, index: KVIndex, *, history_s: float) -> None:
        self.bus = bus
        self.stream = stream
        self.index = index
        self.history_s = history_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        last_ids = {self.stream: history_start_id(time.time(), self.history_s)}
        self._task = asyncio.create_task(self._read(last_ids), name="gateway-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _read(self, last_ids: dict[str, str]) -> None:
        """Runs for the gateway's life; the bus retries through Redis outages itself."""
        while True:
            try:
                deliveries = await self.bus.read(last_ids, count=512, block_ms=READ_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading the kvevents stream failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                msg = delivery.message
                if not isinstance(msg, KVEvents):
                    log.warning("unexpected %s on the kvevents stream", msg.TYPE)
                    continue
                try:
                    self.index.apply(msg)
                except ValueError as exc:
                    log.error("KV events of group %s refused: %s", msg.group, exc)
