"""Which chunks of a KV transfer this worker can move: a pure check of the plan against the
cache, shared by rank 0's connector and the other ranks of a tensor-parallel group, so that
every rank takes part in the same collectives for the same chunks without being told.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.kv.offload_key import KeySpace
from shared.protocol import KVTransfer

Chunk = tuple[str, int, int]  # (payload key, group, block id)


@dataclass(frozen=True)
class ChunkCheck:
    key_space: KeySpace
    num_groups: int
    num_blocks: int  # the attention pool's blocks
    #: Groups whose ids index the state pool, and its size (a hybrid's state group).
    state_groups: frozenset[int] = frozenset()
    num_state_blocks: int = 0

    def split(self, transfer: KVTransfer) -> tuple[list[Chunk], list[str], str | None]:
        """Valid chunks, and the keys (with the first reason) this worker cannot move."""
        keys, groups, blocks = transfer.keys, list(transfer.groups), list(transfer.block_ids)
        if not len(keys) == len(groups) == len(blocks):
            return [], list(keys), f"{len(keys)} keys, {len(groups)} groups, {len(blocks)} blocks"
        valid: list[Chunk] = []
        failed: list[str] = []
        reason: str | None = None
        for key, group, block in zip(keys, groups, blocks, strict=True):
            problem = self.problem(key, group, block)
            if problem is None:
                valid.append((key, group, block))
            else:
                failed.append(key)
                reason = reason or f"{key}: {problem}"
        return valid, failed, reason

    def problem(self, key: str, group: int, block: int) -> str | None:
        if not 0 <= group < self.num_groups:
            return f"group {group} outside this worker's {self.num_groups} group(s)"
        if group in self.state_groups:
            if not 0 <= block < self.num_state_blocks:
                return f"block {block} outside the state pool's {self.num_state_blocks} blocks"
        elif not 0 <= block < self.num_blocks:
            return f"block {block} outside the cache's {self.num_blocks} blocks"
        if not key.startswith(self.key_space.payload_prefix):
            return f"not a payload key of {self.key_space.payload_prefix}*"
        try:
            named = self.key_space.parse(key).group
        except ValueError as exc:
            return str(exc)
        return None if named == group else f"key names group {named}, chunk says {group}"


def by_group(chunks: list[Chunk]) -> dict[int, list[Chunk]]:
    """The chunks per KV cache group, groups in first-seen order (the same on every rank)."""
    out: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        out.setdefault(chunk[1], []).append(chunk)
    return out
