"""What the prefix cache gained and lost since it was last asked: the content of the group's
KVEvents batches (shared/protocol/kv_events.py), which gateways route by.

Only KV cache group 0 is reported: a gateway matches a prompt's block hashes against one set
per worker group, and group 0's blocks are the prompt's full-attention prefix (its hashes equal
the other groups' anyway; they differ only in which blocks a group keeps).

Coalescing: per hash, the last change wins. A block stored and evicted within one batch is
reported removed (a reader that never saw it stored drops nothing), one evicted and stored
again is reported stored, so a batch is a set of final states and its order does not matter.
"""

from __future__ import annotations

from shared.kv.block_hash import BlockHash

REPORTED_GROUP = 0


class KVEventLog:
    def __init__(self) -> None:
        self._changes: dict[BlockHash, bool] = {}  # hash -> held (True) or gone (False)
        self.cleared = False  # the whole cache was dropped since the last take

    def stored(self, block_hash: BlockHash, group_id: int) -> None:
        if group_id == REPORTED_GROUP:
            self._changes[block_hash] = True

    def removed(self, block_hash: BlockHash, group_id: int) -> None:
        if group_id == REPORTED_GROUP:
            self._changes[block_hash] = False

    def clear(self) -> None:
        """The cache was reset: what was reported before is void (the next batch should be a
        snapshot)."""
        self._changes.clear()
        self.cleared = True

    def __bool__(self) -> bool:
        return bool(self._changes) or self.cleared

    def take(self) -> tuple[list[BlockHash], list[BlockHash], bool]:
        """(stored, removed, cleared) since the last take; the log starts empty again."""
        changes, cleared = self._changes, self.cleared
        self._changes, self.cleared = {}, False
        stored = [h for h, held in changes.items() if held]
        removed = [h for h, held in changes.items() if not held]
        return stored, removed, cleared
