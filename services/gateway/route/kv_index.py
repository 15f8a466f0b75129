"""The prefix blocks each worker group holds, as its scheduler reports them (KVEvents), and how
much of a prompt's prefix each group could serve from its cache. Pure.

Per group: its scheduler's incarnation, its block size, and the set of block hashes it holds
(chained hashes, shared/kv/block_hash.py: one hash names a whole prefix, so a prompt's overlap
with a group is the number of its leading block hashes in that set). A snapshot replaces the
group's set; a new incarnation (a restarted scheduler starts with an empty cache) drops it.
The router also `predict`s: blocks of a prompt it just routed count as held by that group until
the group says otherwise, so a burst of requests sharing a prefix follows the first one instead
of scattering before the first one's prefill is reported (Dynamo's router does the same). A
prediction that never comes true (the request was aborted before its prefill) lives until the
group's next snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.kv.block_hash import BlockHash
from shared.protocol import KVEvents
from shared.protocol.kv_events import unpack_hashes


@dataclass
class GroupBlocks:
    incarnation: str
    block_size: int
    hashes: set[BlockHash] = field(default_factory=set)


class KVIndex:
    def __init__(self) -> None:
        self._groups: dict[str, GroupBlocks] = {}
        self.events_applied = 0

    def apply(self, event: KVEvents) -> None:
        """Take one batch or snapshot (a malformed hash blob raises ValueError, and nothing of
        the event is applied)."""
        stored, removed = unpack_hashes(event.stored), unpack_hashes(event.removed)
        held = self._groups.get(event.group)
        if held is None or held.incarnation != event.incarnation or event.snapshot:
            held = GroupBlocks(event.incarnation, event.block_size)
            self._groups[event.group] = held
        held.block_size = event.block_size
        held.hashes.difference_update(removed)
        held.hashes.update(stored)
        self.events_applied += 1

    def predict(self, group: str, hashes: Iterable[BlockHash]) -> None:
        held = self._groups.get(group)
        if held is not None:
            held.hashes.update(hashes)

    def drop(self, group: str) -> None:
        """Forget a group that left the mesh."""
        self._groups.pop(group, None)

    def groups(self) -> list[str]:
        return sorted(self._groups)

    def block_size(self, group: str) -> int | None:
        held = self._groups.get(group)
        return held.block_size if held is not None else None

    def num_blocks(self, group: str) -> int:
        held = self._groups.get(group)
        return len(held.hashes) if held is not None else 0

    def overlap(self, group: str, hashes: list[BlockHash]) -> int:
        """How many leading blocks of a prompt with these block hashes the group holds."""
        held = self._groups.get(group)
        if held is None:
            return 0
        n = 0
        for block_hash in hashes:
            if block_hash not in held.hashes:
                break
            n += 1
        return n
