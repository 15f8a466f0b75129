"""Request-level KV cache management: prefix lookup, admission estimates, allocation.

The one invariant admission rests on: `blocks_to_allocate(...)` is exactly the number of
blocks `allocate_slots(...)` with the same arguments takes out of each pool's free queue
(new blocks plus prefix-hit blocks revived from the free queue); `estimate_blocks_to_allocate`
is their sum. An over-estimate would starve a long request at the head of the queue forever;
an under-estimate would over-commit a pool. Both calls go through the same per-group
`get_num_blocks_to_allocate`, so they cannot drift.

Pools: the attention pool (`num_gpu_blocks`) and, for a hybrid model whose worker sized one,
the state pool (`num_state_blocks`) that state groups draw from (kv_cache_coordinator.py). A
request fits only if every pool has its share free: a full state pool blocks admission however
many attention blocks are free, and the reverse. `usage` (the load reported for routing) is
the fuller pool's.

Prefix-cache registration happens at allocation (as in vLLM v1): `allocate_slots` registers
every block that the planned step makes full, before the worker has written it. That is what
lets n sibling requests admitted in one step share their prompt: the 2nd..nth find the 1st's
blocks. It is sound because the worker writes the K/V of the whole flat batch into the cache,
layer by layer, before any attention of that layer reads it (services/worker/attention/reference.py:
`paged_attention` calls `write_kv` first), so a request reading a block that another request
of the same step fills sees it written. Until the step succeeds, the blocks it registered are
"unwritten": `take_newly_cached` hands them to the scheduler, which keeps them per step and
calls `uncache` if the step fails, so a failed step never leaves a findable hash on a block
without its KV.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from services.scheduler.kv.kv_cache_coordinator import KVCacheBlocks, KVCacheCoordinator
from services.scheduler.request import Request


@dataclass
class PrefixCacheStats:
    """Counted once per admission (not per lookup: a request blocked at the head of the queue
    is looked up every step and would inflate the queries)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.max_step_tokens = config.max_num_batched_tokens
        self.pool = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching)
        self.state_pool = (
            BlockPool(config.num_state_blocks, config.enable_prefix_caching)
            if config.num_state_blocks
            else None
        )
        self.coordinator = KVCacheCoordinator(
            config.kv_cache_groups, self.pool, config.enable_prefix_caching, self.state_pool
        )
        self.pools = self.coordinator.pools  # attention pool first
        self.stats = PrefixCacheStats()
        self.no_blocks = self.coordinator.empty_blocks()  # read-only: no prefix hit, no new blocks
        # Blocks registered by allocations since the last `take_newly_cached` (not yet written).
        self._newly_cached: list[KVCacheBlock] = []

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of every pool together."""
        return sum(pool.num_free_blocks for pool in self.pools)

    @property
    def num_usable_blocks(self) -> int:
        """Usable blocks of every pool together."""
        return sum(pool.num_usable_blocks for pool in self.pools)

    @property
    def usage(self) -> float:
        """The fuller pool's usage: what bounds admission first."""
        return max(pool.usage for pool in self.pools)

    def empty_blocks(self) -> KVCacheBlocks:
        return self.coordinator.empty_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request: blocks per group, and its token count.

        Capped at `num_tokens - 1`: the last known token must be computed to get the logits
        for the next one, so a fully cached prompt still recomputes its last block.
        A request asking for routed experts or prompt logprobs gets no hit (see below).
        """
        if not self.enable_caching or request.computes_every_position:
            # Routed experts and prompt logprobs come from the forward: every prompt position
            # must be computed, so such a request never starts from a cached prefix.
            return self.coordinator.empty_blocks(), 0
        return self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)

    def estimate_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int | None = None,
    ) -> int:
        """Blocks `allocate_slots` with these arguments would take, all pools together."""
        return sum(
            self.blocks_to_allocate(
                request, num_new_tokens, new_computed_blocks, num_new_computed_tokens
            )
        )

    def blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int | None = None,
    ) -> list[int]:
        """Blocks `allocate_slots` with these arguments would take from each pool (`pools`
        order)."""
        blocks = new_computed_blocks or self.no_blocks
        num_tokens = self._num_slots(request, num_new_tokens, blocks, num_new_computed_tokens)
        return self.coordinator.blocks_needed(request.request_id, num_tokens, blocks)

    def fits(self, needed: list[int]) -> bool:
        """Whether every pool has its count of a `blocks_to_allocate` list free."""
        return self.coordinator.fits(needed)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int | None = None,
    ) -> KVCacheBlocks | None:
        """Give the request slots for `num_new_tokens` more tokens after its computed ones
        (including the prefix hit `new_computed_blocks`, for a request being admitted).

        Returns the newly allocated blocks per group (not the hit blocks; read-only lists), or
        None, changing nothing, if a pool cannot supply its share. On success, the blocks these
        tokens make full are registered in the prefix cache (see the module docstring), so a
        request allocated after this one in the same step can hit them.
        """
        coordinator = self.coordinator
        blocks = new_computed_blocks or self.no_blocks
        request_id = request.request_id
        if coordinator.drops_blocks:
            # Skipped blocks go back before counting, so they can serve this very allocation.
            coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        num_tokens = self._num_slots(request, num_new_tokens, blocks, num_new_computed_tokens)
        needed = coordinator.blocks_needed(request_id, num_tokens, blocks)
        if new_computed_blocks is None and not any(needed):
            new_blocks = self.no_blocks  # the common decode step: its last block has room
        elif not coordinator.fits(needed):
            return None
        else:
            if new_computed_blocks:
                coordinator.save_new_computed_blocks(request_id, blocks)
            new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens)
        # Only blocks with known tokens can be full: slots reserved past them (lookahead)
        # hold nothing hashable yet.
        # With async scheduling the known tokens trail the slots by the in-flight placeholders,
        # so a block is registered at the first allocation after its last token is known (the
        # managers skip blocks registered before: most decode steps register nothing).
        num_cached = min(num_tokens, request.num_tokens)
        if self.enable_caching and num_cached >= self.block_size:
            self._newly_cached += coordinator.cache_blocks(
                request_id, request.block_hashes, num_cached
            )
        return new_blocks

    def take_newly_cached(self) -> list[KVCacheBlock]:
        """The blocks registered by allocations since the last call, whose KV the planned step
        is yet to write; the caller owns the list (and `uncache`s it if the step fails)."""
        blocks, self._newly_cached = self._newly_cached, []
        return blocks

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the prefix hashes of blocks whose KV was never written (a failed step).
        Each block goes back to its group's pool (the group is part of its cache key)."""
        coordinator = self.coordinator
        for block in blocks:
            if block.block_hash is not None:
                coordinator.pool_of_group(block.block_hash[1]).uncache_blocks((block,))

    def uncache_newly_cached(self, request: Request) -> None:
        """Unregister the blocks the request's allocations registered since the last
        `take_newly_cached`: it leaves the step being planned (a preemption victim scheduled
        earlier in the pass), so no step will write them. Call before freeing it: its block
        table names them. Nobody else holds them (a block registered now was hit by nobody)."""
        held = {id(b) for group in self.coordinator.get_blocks(request.request_id) for b in group}
        if not held or not self._newly_cached:
            return
        mine = [b for b in self._newly_cached if id(b) in held]
        if mine:
            self._newly_cached = [b for b in self._newly_cached if id(b) not in held]
            self.uncache(mine)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks made full by its first `num_computed_tokens` tokens,
        whose KV is already written. (`allocate_slots` registers what each planned step fills;
        this is for callers that manage slots themselves.)"""
        if self.enable_caching:
            self.coordinator.cache_blocks(
                request.request_id, request.block_hashes, num_computed_tokens
            )

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in g] for g in self.coordinator.get_blocks(request_id)]

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Peak blocks of a request of `num_tokens` slots over all groups (admission bound)."""
        return self.coordinator.num_blocks_for_tokens(num_tokens, self.max_step_tokens)

    def too_large(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` slots can never fit (its peak exceeds a pool's usable
        blocks), or None."""
        peak = self.coordinator.peak_blocks(num_tokens, self.max_step_tokens)
        for i, (needed, pool) in enumerate(zip(peak, self.pools, strict=True)):
            if needed > pool.num_usable_blocks:
                kind = "state" if i else "KV"
                return (
                    f"request needs up to {needed} {kind} blocks ({num_tokens} tokens), more "
                    f"than the {pool.num_usable_blocks} the cache holds"
                )
        return None

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()

    def _num_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks,
        num_new_computed_tokens: int | None,
    ) -> int:
        if num_new_computed_tokens is None:
            num_new_computed_tokens = len(new_computed_blocks[0]) * self.block_size
        return request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
