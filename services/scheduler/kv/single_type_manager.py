"""Per-group block managers: one per KV cache group, each drawing from its group's BlockPool
(the attention pool, or a hybrid model's state pool for state groups: kv_cache_coordinator.py).

A manager owns the block table of every request for its group. Block tables are append-only
while a request runs (the worker indexes KV by table position, and a hit found earlier must not
move), and are released whole by `free`. Groups that can drop blocks (sliding window) do it in
`remove_skipped_blocks` by swapping entries for the null block, which keeps positions stable.

Subclasses implement `find_longest_cache_hit` (the scan direction and hit rule are what differ
between attention types) and may override `remove_skipped_blocks`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from services.scheduler.kv.block_pool import BlockPool, KVCacheBlock
from services.scheduler.kv.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    RingSpec,
    SlidingWindowSpec,
    StateSpec,
)
from shared.kv.block_hash import BlockHash


class SingleTypeKVCacheManager(ABC):
    #: Whether `remove_skipped_blocks` can ever release anything (lets the coordinator skip
    #: the per-step call for groups that never drop blocks).
    drops_blocks: ClassVar[bool] = True
    #: Whether every block-aligned prefix of a hit is itself a hit (true for full attention),
    #: so a shorter agreed length is served by truncating, without a new lookup.
    hit_prefix_closed: ClassVar[bool] = False
    #: Whether the group can ever serve a prefix hit (a ring buffer cannot): without it no
    #: group's hit is usable, so the coordinator's hit is 0 without a lookup.
    serves_hits: ClassVar[bool] = True

    def __init__(
        self, spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.enable_caching = enable_caching and spec.locally_cacheable
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def prefix_cacheable(self) -> bool:
        return self.spec.prefix_cacheable

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Blocks holding the longest cached prefix of at most `max_length` tokens (block
        aligned). Nothing is touched: the result is only valid until the pool changes."""

    def table_length(self, num_tokens: int) -> int:
        """Entries of a request's block table covering `num_tokens` slots (one per block;
        a ring's table stops at its ring)."""
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one request of `num_tokens` slots ever holds in this group, when a
        step computes at most `max_step_tokens` of its tokens (admission's feasibility bound)."""
        return self.table_length(num_tokens)

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Blocks the pool loses when this request grows to `num_tokens` slots: brand-new
        blocks, plus prefix-hit blocks that are currently free (touching takes them out of the
        free queue). Exactly what `save_new_computed_blocks` + `allocate_new_blocks` take."""
        blocks = self.req_to_blocks.get(request_id)
        num_new = self.table_length(num_tokens) - len(new_computed_blocks)
        if blocks:
            num_new -= len(blocks)
        if num_new < 0:
            num_new = 0
        if not new_computed_blocks:
            return num_new
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_revived

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Attach prefix-hit blocks to a request that holds no blocks yet."""
        if not new_computed_blocks:
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            raise RuntimeError(f"prefix hit for {request_id}, which already holds blocks")
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        # Hit blocks are cached already: never register them again.
        self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table to cover `num_tokens` slots; returns only the new blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = self.table_length(num_tokens) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> list[KVCacheBlock]:
        """Register the request's blocks that are full within its first `num_tokens` tokens
        (computed, or being computed by the step being planned). Only blocks not registered
        before are visited; returns those registered now."""
        if not self.enable_caching:
            return []
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return []
        blocks = self.req_to_blocks[request_id]
        registered = self.pool.cache_full_blocks(
            blocks[start:num_full], block_hashes[start:num_full], self.group_id
        )
        self.num_cached_blocks[request_id] = num_full
        return registered

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no future token will attend to (swap them for the null block).
        Called before each allocation, so released blocks can serve it."""

    def free(self, request_id: str) -> None:
        """Release the request's whole table, tail first (see BlockPool.free_blocks)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeKVCacheManager):
    drops_blocks = False
    hit_prefix_closed = True

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Scan left to right; the first miss ends the hit (a later block's hash names a prefix
        that includes the missing one, so it cannot be valid KV on its own)."""
        if not self.enable_caching:
            return []
        hits: list[KVCacheBlock] = []
        cached = self.pool.cached
        group_id = self.group_id
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = cached.get((block_hash, group_id))
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Every later token attends to every block: nothing is ever skipped."""
        return None


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding-window group: positions below the window of the next token to compute are
    never read again, so their blocks go back to the pool and their table entries become the
    null block (block 0). The table LENGTH stays ceil(tokens / block_size): the worker indexes
    it by position, and only ever reads or writes inside the window, never a null entry.

    Held blocks stay bounded whatever the sequence length: at most
    ceil((window - 1 + step tokens) / block_size) + 1 (see `max_blocks_held`).
    """

    spec: SlidingWindowSpec | StateSpec

    def __init__(
        self,
        spec: SlidingWindowSpec | StateSpec,
        pool: BlockPool,
        group_id: int,
        enable_caching: bool,
    ) -> None:
        super().__init__(spec, pool, group_id, enable_caching)
        self.sliding_window = spec.sliding_window
        # A hit of h tokens needs positions h - window + 1 .. h - 1 cached: this many blocks
        # ending at h (fewer only when the run reaches position 0).
        self.hit_run_blocks = -(-(spec.sliding_window - 1) // spec.block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """Scan right to left for `hit_run_blocks` consecutive cached blocks; the hit ends at
        the run's end, and the blocks before the run are null (outside the window). Without
        such a run, the leading run from block 0 is still a hit (nothing precedes it)."""
        if not self.enable_caching:
            return []
        num_blocks = min(max_length // self.block_size, len(block_hashes))
        null = self.pool.null_block
        if self.hit_run_blocks == 0:  # window 1: a token reads only itself
            return [null] * num_blocks
        hits: list[KVCacheBlock] = [null] * num_blocks
        cached = self.pool.cached
        group_id = self.group_id
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = cached.get((block_hashes[i], group_id))
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run == self.hit_run_blocks:
                return hits[: i + run]
        # No full window anywhere: `run` is now the leading run from block 0.
        return hits[:run]

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """A step computing n new tokens after c computed ones holds the blocks from the one
        holding position c - window + 1 to the one holding c + n - 1."""
        window_bound = -(-(self.sliding_window - 1 + max_step_tokens) // self.block_size) + 1
        return min(super().max_blocks_held(num_tokens, max_step_tokens), window_bound)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The next token (position `num_computed_tokens`) reads from position
        num_computed_tokens - window + 1 on: every block wholly before that is released, tail
        first (so a cached prefix head is evicted last). Entries already null end the walk:
        everything before them was released by an earlier call."""
        num_skipped = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        if num_skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null = self.pool.null_block
        removed: list[KVCacheBlock] = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block.is_null:
                break
            removed.append(block)
            blocks[i] = null
        self.pool.free_blocks(removed)


class StateManager(SlidingWindowManager):
    """A recurrent-state group (shared/kv/groups.py's entry rule): the bookkeeping of a sliding
    window of 2 positions. A hit of h tokens is the one cached block ending at h (the state after
    exactly those tokens) with null entries before it; the next token reads only the block
    holding position n - 1, so every earlier block goes back to the pool, still registered in
    the prefix cache until evicted.

    Registration lags one allocation behind attention's: a request admitted in the same step
    may hit an attention block that another request fills in that step (the worker writes all
    K/V before any attention reads), but a state is read before the step computes anything,
    so a state block becomes findable only once the step that writes it was planned earlier
    (steps run in plan order). Each call registers what the previous call's length made full,
    and so does `remove_skipped_blocks` before it lets boundary states go back to the pool.
    """

    def __init__(
        self, spec: StateSpec, pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, pool, group_id, enable_caching)
        self._planned: dict[str, int] = {}  # tokens covered by the request's previous call
        self._hashes: dict[str, Sequence[BlockHash]] = {}  # the request's (growing) hash list

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> list[KVCacheBlock]:
        written = self._planned.get(request_id, 0)
        self._planned[request_id] = max(written, num_tokens)
        self._hashes[request_id] = block_hashes
        return super().cache_blocks(request_id, block_hashes, written)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        hashes = self._hashes.get(request_id)
        if hashes is not None:  # states planned before are written: register, then release
            written = min(self._planned.get(request_id, 0), num_computed_tokens)
            super().cache_blocks(request_id, hashes, written)
        super().remove_skipped_blocks(request_id, num_computed_tokens)

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        super().save_new_computed_blocks(request_id, new_computed_blocks)
        # The hit's blocks hold states written by earlier steps: findable already.
        self._planned[request_id] = len(new_computed_blocks) * self.block_size

    def free(self, request_id: str) -> None:
        self._planned.pop(request_id, None)
        self._hashes.pop(request_id, None)
        super().free(request_id)


class RingManager(SingleTypeKVCacheManager):
    """A ring-buffer group (shared/kv/groups.py's slot rule): the table holds only the ring's
    n = ceil(ring_size / block_size) blocks, entry (p // block_size) % n for position p. A
    request gets a new block only when a position first reaches an entry (its first n blocks'
    worth of tokens); after that every position reuses an entry, so the table never grows past
    n and nothing is ever dropped before `free`.

    Never a prefix hit, never registered: a ring entry holds whichever of its positions was
    written last, and no block hash names that. So with a ring group in the model the
    coordinator's agreed hit is always 0 (its fixed point takes the min over groups).
    """

    spec: RingSpec
    drops_blocks = False
    hit_prefix_closed = True  # an empty hit is trivially prefix-closed
    serves_hits = False

    def __init__(self, spec: RingSpec, pool: BlockPool, group_id: int, enable_caching: bool):
        super().__init__(spec, pool, group_id, enable_caching)
        self.n_ring_blocks = spec.n_ring_blocks

    def entry_of(self, position: int) -> int:
        """The table entry holding `position` (the slot rule)."""
        return (position // self.block_size) % self.n_ring_blocks

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        return []

    def table_length(self, num_tokens: int) -> int:
        """The ring entries `num_tokens` positions reach (at most n): allocation, estimate and
        admission bound all follow from it."""
        return min(super().table_length(num_tokens), self.n_ring_blocks)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        if new_computed_blocks:
            raise ValueError("a ring group serves no prefix hit")
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks)

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        if new_computed_blocks:
            raise ValueError("a ring group serves no prefix hit")

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> list[KVCacheBlock]:
        return []  # no hash names a ring entry's contents

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Every ring entry is reused by a later position: nothing is ever skipped."""
        return None


MANAGER_BY_SPEC: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    StateSpec: StateManager,
    RingSpec: RingManager,
}


def make_manager(
    spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool
) -> SingleTypeKVCacheManager:
    try:
        cls = MANAGER_BY_SPEC[type(spec)]
    except KeyError:
        raise ValueError(f"no KV cache manager for spec {type(spec).__name__}") from None
    return cls(spec, pool, group_id, enable_caching)  # type: ignore[arg-type]
