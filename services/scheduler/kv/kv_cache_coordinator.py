"""Fans request-level KV operations out to one manager per KV cache group.

With several groups, a prefix hit is usable only up to a length EVERY group can serve. For full
attention any shorter prefix of a hit is a hit, so cutting its list back is exact. A sliding
window's hit is a run of cached blocks ending at the hit length, so its hit at a shorter length
is a different question (the window blocks before the shorter end must be cached): as vLLM's
HybridKVCacheCoordinator does, the lookup iterates to a fixed point, re-asking every
non-prefix-closed group at the agreed length until no group shortens it.

A ring-buffer group serves no hit at all (its entries hold whichever position was written
last, which no block hash names), so with a ring group in the model every hit is 0.

Admission bound: a request's peak demand is the sum over groups of `max_blocks_held` (a
sliding-window group holds a bounded number of blocks however long the request runs).

Pools: attention groups draw block ids from the attention pool; state groups (recurrent
states of hybrid models) from their own state pool when the worker sized one
(`num_state_blocks`, SGLang's MambaPool beside its KV pool), else from the attention pool as
well (a worker that announced no state pool keeps both kinds under one id space). Demand and
free blocks are counted per pool: `blocks_needed` lists one count per pool in `pools` order,
and a request fits only if every pool has its count free.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from services.scheduler.kv.kv_cache_spec import KVCacheGroup, StateSpec
from services.scheduler.kv.single_type_manager import SingleTypeKVCacheManager, make_manager
from shared.kv.block_hash import BlockHash

KVCacheBlocks = list[list[KVCacheBlock]]
"""One block list per KV cache group, in group order."""


class KVCacheCoordinator:
    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        pool: BlockPool,
        enable_caching: bool,
        state_pool: BlockPool | None = None,
    ):
        if not groups:
            raise ValueError("at least one KV cache group is required")
        sizes = {g.spec.block_size for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"all KV cache groups must share one block size, got {sorted(sizes)}")
        is_state = [isinstance(g.spec, StateSpec) for g in groups]
        if state_pool is not None and not any(is_state):
            raise ValueError("a state pool without a state group")
        self.block_size = sizes.pop()
        self.pool = pool
        #: The distinct pools, attention pool first; `pool_index[g]` is group g's.
        self.pools: list[BlockPool] = [pool] if state_pool is None else [pool, state_pool]
        self.pool_index = [int(state_pool is not None and s) for s in is_state]
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(g.spec, self.pools[p], i, enable_caching)
            for i, (g, p) in enumerate(zip(groups, self.pool_index, strict=True))
        ]
        self.num_groups = len(self.managers)
        self._dropping = [m for m in self.managers if m.drops_blocks]
        self.drops_blocks = bool(self._dropping)
        # A group that never serves a hit (a ring buffer) makes every hit 0: the agreed length
        # is a min over groups, and the ring's contents at any earlier length are gone.
        self.serves_hits = all(m.serves_hits for m in self.managers)

    def empty_blocks(self) -> KVCacheBlocks:
        return [[] for _ in self.managers]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[KVCacheBlocks, int]:
        """The longest block-aligned length <= `max_length` that every group serves, and each
        group's blocks for exactly that length.

        Terminates: each pass either leaves the length unchanged (done) or shortens it, and at
        0 every group agrees. On exit every group was asked (or truncated) at the final length
        in the last pass and served all of it, so each list is an exact hit of that length.
        """
        block_size = self.block_size
        if not self.serves_hits:
            return self.empty_blocks(), 0
        if self.num_groups == 1:
            hit = self.managers[0].find_longest_cache_hit(block_hashes, max_length)
            return [hit], len(hit) * block_size
        hits: KVCacheBlocks = [[] for _ in self.managers]
        asked = [False] * self.num_groups
        length = max_length - max_length % block_size
        while True:
            agreed = length
            for g, manager in enumerate(self.managers):
                if manager.hit_prefix_closed and asked[g]:
                    hits[g] = hits[g][: agreed // block_size]
                else:
                    hits[g] = manager.find_longest_cache_hit(block_hashes, agreed)
                    asked[g] = True
                agreed = min(agreed, len(hits[g]) * block_size)
            if agreed == length:
                break
            length = agreed
        num_blocks = length // block_size
        return [h[:num_blocks] for h in hits], length

    def pool_of_group(self, group_id: int) -> BlockPool:
        return self.pools[self.pool_index[group_id]]

    def blocks_needed(
        self, request_id: str, num_tokens: int, new_computed_blocks: KVCacheBlocks
    ) -> list[int]:
        """Blocks each pool (in `pools` order) loses when the request grows to `num_tokens`
        slots with this prefix hit: exactly what `save_new_computed_blocks` +
        `allocate_new_blocks` take from it."""
        if self.num_groups == 1:
            return [
                self.managers[0].get_num_blocks_to_allocate(
                    request_id, num_tokens, new_computed_blocks[0]
                )
            ]
        needed = [0] * len(self.pools)
        for manager, p, blocks in zip(
            self.managers, self.pool_index, new_computed_blocks, strict=True
        ):
            needed[p] += manager.get_num_blocks_to_allocate(request_id, num_tokens, blocks)
        return needed

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: KVCacheBlocks
    ) -> int:
        """`blocks_needed` over all pools together."""
        return sum(self.blocks_needed(request_id, num_tokens, new_computed_blocks))

    def fits(self, needed: Sequence[int]) -> bool:
        """Whether every pool has its count of `needed` (a `blocks_needed` list) free."""
        return all(n <= pool.num_free_blocks for n, pool in zip(needed, self.pools, strict=True))

    def peak_blocks(self, num_tokens: int, max_step_tokens: int) -> list[int]:
        """Blocks per pool a request of `num_tokens` slots holds at its peak with no prefix
        hit, when a step computes at most `max_step_tokens` of its tokens."""
        peak = [0] * len(self.pools)
        for manager, p in zip(self.managers, self.pool_index, strict=True):
            peak[p] += manager.max_blocks_held(num_tokens, max_step_tokens)
        return peak

    def num_blocks_for_tokens(self, num_tokens: int, max_step_tokens: int) -> int:
        """`peak_blocks` over all pools together."""
        return sum(self.peak_blocks(num_tokens, max_step_tokens))

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
