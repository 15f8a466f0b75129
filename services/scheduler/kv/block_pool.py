"""A physical block pool: the attention pool that every attention group (full, sliding window)
draws from, or a hybrid model's state pool of its state groups (the worker sizes them apart:
a state block holds one recurrent state per state layer, an attention block `block_size`
tokens of K/V per attention layer; kv_cache_coordinator.py maps groups to pools). Each pool
has its own id space, null block, prefix-cache map and LRU free queue.

Invariants:
- A block is in the free queue iff its ref_cnt is 0 (the null block is never in it).
- A block with a `block_hash` holds the KV of exactly that prefix and is findable through
  `cached`; it stays findable while free, until it is handed out again (evicted).
- The free queue is in LRU order: blocks are taken from the head, freed blocks are appended at
  the tail. A free block is "free" for admission purposes even if cached: taking it evicts it.

Block 0 of each pool is reserved as the null block: never allocated, never freed. Groups that
drop blocks (sliding window, state) point skipped table entries at it, and the worker may use
it as padding. So `num_blocks` pool blocks give `num_blocks - 1` usable ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.scheduler.kv.kv_event_log import REPORTED_GROUP, KVEventLog
from shared.kv.block_hash import BlockHash

CacheKey = tuple[BlockHash, int]
"""(block hash, group id): the same prefix has a distinct physical block in each group."""


class KVCacheBlock:
    """One physical block of KV slots (block_size tokens, every layer of its group)."""

    __slots__ = ("block_hash", "block_id", "is_null", "ref_cnt")

    def __init__(self, block_id: int, is_null: bool = False) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: CacheKey | None = None
        self.is_null = is_null

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash!r})"


class BlockPool:
    """Hands out and takes back blocks; keeps the prefix-cache map of full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (1 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        # OrderedDict gives O(1) pop from the head, append at the tail and removal from the
        # middle (a cached block revived by a prefix hit), all in C.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self.cached: dict[CacheKey, KVCacheBlock] = {}
        self.events = KVEventLog()  # what `cached` gained and lost, for KV-aware routing

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_usable_blocks

    def reported_hashes(self) -> list[BlockHash]:
        """Every prefix hash of the reported KV group held now (a KVEvents snapshot)."""
        return [h for h, group_id in self.cached if group_id == REPORTED_GROUP]

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self.cached.get((block_hash, group_id))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the LRU head, evicting their cached hashes; ref_cnt becomes 1."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot take {n} blocks, only {len(self.free_queue)} free")
        out: list[KVCacheBlock] = []
        pop = self.free_queue.popitem
        for _ in range(n):
            block = pop(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit (reviving them if free)."""
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                del queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue tail in the given
        order. Callers pass a request's blocks tail first, so its tail is evicted before its
        head: the head of a prefix (shared by the most future prompts) lives longest, and a
        cached suffix is never left without its head."""
        queue = self.free_queue
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue[block.block_id] = block
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        group_id: int,
    ) -> list[KVCacheBlock]:
        """Register full blocks under their prefix hashes (blocks[i] holds block_hashes[i]);
        returns the blocks that got registered now.

        If another block already holds the same prefix (two requests computed it at the same
        time), the first one stays the cached copy and this one stays anonymous: a block's
        identity in a request's block table never changes, and it is simply reused when freed.
        """
        registered: list[KVCacheBlock] = []
        if not self.enable_caching:
            return registered
        cached = self.cached
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block.is_null:
                continue
            key = (block_hash, group_id)
            if key not in cached:
                block.block_hash = key
                cached[key] = block
                registered.append(block)
                self.events.stored(block_hash, group_id)
        return registered

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Make blocks unfindable again (their KV was never written: the step that was to write
        it failed). Blocks stay wherever they are (a request's table, the free queue)."""
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the worker lost its KV). Only valid with no block in use,
        since a request's blocks must keep the hashes it registered."""
        in_use = self.num_usable_blocks - len(self.free_queue)
        if in_use:
            raise RuntimeError(f"cannot reset the prefix cache with {in_use} blocks in use")
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.events.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if key is not None and self.cached.get(key) is block:
            del self.cached[key]
            self.events.removed(*key)
        block.block_hash = None
