"""Staging slots and block copies: gather then scatter moves every layer's K and V of a block
into another block; slots are handed out all or nothing."""

from __future__ import annotations

import torch

from services.worker.kv_offload.staging import StagingPool, gather_blocks, scatter_blocks


def test_gather_then_scatter_moves_blocks_to_other_ids() -> None:
    torch.manual_seed(0)
    layers = [torch.randn(2, 10, 4, 2, 8) for _ in range(3)]
    pool = StagingPool((3, 2, 4, 2, 8), torch.float32, num_slots=4, pinned=False)
    slots = pool.acquire(2)
    assert slots is not None
    assert gather_blocks(layers, [7, 2], pool, slots) is None  # CPU: complete on return
    chunks = pool.buffer[slots]
    assert torch.equal(chunks[0, 1], layers[1][:, 7]) and torch.equal(chunks[1, 2], layers[2][:, 2])
    before = [layer.clone() for layer in layers]
    scatter_blocks(layers, [0, 9], chunks)
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[:, 0], old[:, 7]) and torch.equal(layer[:, 9], old[:, 2])
        assert torch.equal(layer[:, 1:9], old[:, 1:9])  # nothing else touched


def test_slots_are_all_or_nothing_and_reused() -> None:
    pool = StagingPool.sized((1, 2, 4, 1, 4), torch.float32, budget_bytes=3 * 128, pinned=False)
    assert pool.num_slots == 3
    first = pool.acquire(2)
    assert first is not None and pool.acquire(2) is None and pool.num_free == 1
    pool.release(first)
    again = pool.acquire(3)
    assert again is not None and sorted(again) == [0, 1, 2]
    assert StagingPool.sized((1, 2, 4, 1, 4), torch.float32, 1, pinned=False).num_slots == 1
