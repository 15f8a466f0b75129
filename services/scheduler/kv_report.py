"""The group's KVEvents (shared/protocol/kv_events.py): which prefix blocks its cache holds, as
gateways route by them. Pure: the service asks for the message due now and sends it.

A batch of changes goes out with the step that made them (the block pool's event log). A
snapshot, all blocks held, goes out first (a new scheduler process or a new core), after the
cache was reset (a new worker), and every `snapshot_interval_s`, so a gateway that starts late
or missed events is right again within that interval.
"""

from __future__ import annotations

from services.scheduler.kv.block_pool import BlockPool
from shared.protocol import KVEvents
from shared.protocol.kv_events import pack_hashes


class KVReport:
    def __init__(
        self, group: str, scheduler_id: str, incarnation: str, snapshot_interval_s: float
    ) -> None:
        self.group = group
        self.scheduler_id = scheduler_id
        self.incarnation = incarnation
        self.snapshot_interval_s = snapshot_interval_s
        self._pool: BlockPool | None = None
        self._snapshot_at = float("-inf")
        self.sent = 0

    def due(self, pool: BlockPool, block_size: int, now: float) -> KVEvents | None:
        """The message to send now, or None."""
        snapshot = pool is not self._pool or now - self._snapshot_at >= self.snapshot_interval_s
        if not snapshot and not pool.events:
            return None
        stored, removed, cleared = pool.events.take()
        if snapshot or cleared:
            self._pool, self._snapshot_at = pool, now
            msg = self._message(block_size, now, snapshot=True, stored=pool.reported_hashes())
        else:
            msg = self._message(block_size, now, stored=stored, removed=removed)
        self.sent += 1
        return msg

    def _message(
        self,
        block_size: int,
        now: float,
        *,
        snapshot: bool = False,
        stored: list[bytes] | None = None,
        removed: list[bytes] | None = None,
    ) -> KVEvents:
        return KVEvents(
            group=self.group,
            scheduler_id=self.scheduler_id,
            incarnation=self.incarnation,
            block_size=block_size,
            snapshot=snapshot,
            stored=pack_hashes(stored or []),
            removed=pack_hashes(removed or []),
            time=now,
        )
