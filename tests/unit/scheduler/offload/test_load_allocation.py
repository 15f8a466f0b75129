"""Admission estimates equal allocations on the load paths (CONTRACTS.md), and a load's blocks
are not findable in the prefix cache before the load completed."""

from __future__ import annotations

import pytest

from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.offload.load_allocation import allocate_for_load, blocks_for_load
from services.scheduler.request import Request
from shared.protocol import SamplingParams
from tests.unit.scheduler.offload.harness import BLOCK, config

PROMPT = list(range(1000, 1030))  # 30 tokens: 7 full blocks


def request(rid: str, prompt: list[int] = PROMPT) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), "replies:x", BLOCK)


def cached_prefix(kv: KVCacheManager, num_tokens: int) -> None:
    """Another request computed `num_tokens` of the prompt and finished: cached, free blocks."""
    other = request("other", PROMPT[:num_tokens])
    assert kv.allocate_slots(other, num_tokens) is not None
    kv.free(other)


@pytest.mark.parametrize("local_hit_tokens", [0, 8])
@pytest.mark.parametrize("load_blocks", [1, 5])
def test_estimate_equals_allocation_for_the_load_and_the_resumed_admission(
    local_hit_tokens: int, load_blocks: int
) -> None:
    kv = KVCacheManager(config(num_gpu_blocks=32))
    if local_hit_tokens:
        cached_prefix(kv, local_hit_tokens)
    req = request("r")
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    assert num_hit == local_hit_tokens
    num_load = load_blocks * BLOCK
    estimate = blocks_for_load(kv, req, hit_blocks, num_hit, num_load)
    free = kv.num_free_blocks
    new_blocks = allocate_for_load(kv, req, hit_blocks, num_hit, num_load)
    assert new_blocks is not None and len(new_blocks[0]) == load_blocks
    assert free - kv.num_free_blocks == estimate
    # Not findable before the load is done: another request sees only the local hit.
    assert kv.get_computed_blocks(request("probe"))[1] == local_hit_tokens
    # Load done: computed and cached; the resumed admission computes the rest.
    total = num_hit + num_load
    kv.cache_blocks(req, total)
    assert kv.get_computed_blocks(request("probe"))[1] == total
    num_new = req.num_tokens - total
    estimate = kv.estimate_blocks_to_allocate(req, num_new, None, total)
    free = kv.num_free_blocks
    assert kv.allocate_slots(req, num_new, None, total) is not None
    assert free - kv.num_free_blocks == estimate
    assert len(kv.get_block_ids("r")[0]) == -(-req.num_tokens // BLOCK)


def test_a_load_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(config(num_gpu_blocks=4))  # 3 usable blocks
    req = request("r")
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    assert blocks_for_load(kv, req, hit_blocks, num_hit, 4 * BLOCK) == 4
    assert allocate_for_load(kv, req, hit_blocks, num_hit, 4 * BLOCK) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids("r") == [[]]
