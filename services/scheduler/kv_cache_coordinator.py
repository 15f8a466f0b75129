"""Fans request-level KV operations out to one manager per KV cache group.

With several groups, a prefix hit is usable only up to the length every group can serve, so
the hit is the minimum over groups, and each group's hit list is cut back to it. That is exact
for full-attention groups (any shorter prefix of a hit is a hit). A sliding-window group will
need vLLM's fixed-point iteration (its hit at a shorter length must be re-checked); that goes in
here when such a group exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.block_hash import BlockHash
from services.scheduler.block_pool import BlockPool, KVCacheBlock
from services.scheduler.kv_cache_spec import KVCacheGroup
from services.scheduler.single_type_manager import SingleTypeKVCacheManager, make_manager

KVCacheBlocks = list[list[KVCacheBlock]]
"""One block list per KV cache group, in group order."""


class KVCacheCoordinator:
    def __init__(self, groups: Sequence[KVCacheGroup], pool: BlockPool, enable_caching: bool):
        if not groups:
            raise ValueError("at least one KV cache group is required")
        sizes = {g.spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"all KV cache groups must share one block size, got {sorted(sizes)}")
        self.block_size = sizes.pop()
        self.pool = pool
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(g.spec, pool, i, enable_caching) for i, g in enumerate(groups)
        ]
        self.num_groups = len(self.managers)
        self._dropping = [m for m in self.managers if m.drops_blocks]
        self.drops_blocks = bool(self._dropping)

    def empty_blocks(self) -> KVCacheBlocks:
        return [[] for _ in self.managers]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[KVCacheBlocks, int]:
        hits: KVCacheBlocks = []
        length = max_length
        for manager in self.managers:
            group_hit = manager.find_longest_cache_hit(block_hashes, length)
            length = min(length, len(group_hit) * self.block_size)
            hits.append(group_hit)
        num_blocks = length // self.block_size
        return [h[:num_blocks] for h in hits], num_blocks * self.block_size

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: KVCacheBlocks
    ) -> int:
        if self.num_groups == 1:
            return self.managers[0].get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[0]
            )
        total = 0
        for manager, blocks in zip(self.managers, new_computed_blocks, strict=True):
            total += manager.get_num_blocks_to_allocate(request_id, num_tokens, blocks)
        return total

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` slots holds at its peak with no prefix hit."""
        return self.num_groups * -(-num_tokens // self.block_size)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self._dropping:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: KVCacheBlocks) -> None:
        for i, m in enumerate(self.managers):
            m.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> KVCacheBlocks:
        return [m.allocate_new_blocks(request_id, num_tokens) for m in self.managers]

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> list[KVCacheBlock]:
        """Register full blocks in every group; returns the blocks registered now."""
        if self.num_groups == 1:
            return self.managers[0].cache_blocks(request_id, block_hashes, num_tokens)
        registered: list[KVCacheBlock] = []
        for m in self.managers:
            registered += m.cache_blocks(request_id, block_hashes, num_tokens)
        return registered

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return [m.blocks_of(request_id) for m in self.managers]
