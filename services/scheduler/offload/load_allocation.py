"""Blocks for an external load: taken like an admission, registered in the prefix cache later.

A normal allocation registers the blocks its step fills at once (KVCacheManager explains why
that is sound: the step writes them before anyone reads them). A load is different: its blocks
are filled by a background transfer that may take several steps or fail, so a hash registered
now could let another request "hit" a block that holds nothing yet. So the load's blocks are
allocated here without registration; `KVCacheManager.cache_blocks` registers them once the
worker reported the load done.

The admission invariant still holds: `blocks_for_load` is `estimate_blocks_to_allocate` with
the same arguments, and `allocate_for_load` takes exactly that many blocks from the free queues
(revived prefix-hit blocks plus new ones), through the same per-group managers; it checks each
pool (attention, and a hybrid's state pool) against its own free blocks.
"""

from __future__ import annotations

from services.scheduler.kv.kv_cache_coordinator import KVCacheBlocks
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request


def blocks_for_load(
    kv: KVCacheManager,
    request: Request,
    hit_blocks: KVCacheBlocks,
    num_hit_tokens: int,
    num_load_tokens: int,
) -> int:
    """Blocks `allocate_for_load` with these arguments takes from the pool."""
    return kv.estimate_blocks_to_allocate(request, num_load_tokens, hit_blocks, num_hit_tokens)


def allocate_for_load(
    kv: KVCacheManager,
    request: Request,
    hit_blocks: KVCacheBlocks,
    num_hit_tokens: int,
    num_load_tokens: int,
) -> KVCacheBlocks | None:
    """Attach the local prefix hit and allocate blocks for `num_load_tokens` loaded tokens after
    it; returns the new blocks per group, or None (changing nothing) when the pool lacks them.
    The request must hold no blocks yet (it is being admitted)."""
    needed = kv.blocks_to_allocate(request, num_load_tokens, hit_blocks, num_hit_tokens)
    if not kv.fits(needed):
        return None
    coordinator = kv.coordinator
    coordinator.save_new_computed_blocks(request.request_id, hit_blocks)
    return coordinator.allocate_new_blocks(
        request.request_id, request.num_computed_tokens + num_hit_tokens + num_load_tokens
    )
