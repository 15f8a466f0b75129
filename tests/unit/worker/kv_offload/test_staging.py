"""Staging slots and block copies: gather then scatter (the CPU's context KV write) moves every
layer's K and V of a block into another block; a slot's payload is the chunk's header and body,
as `pack_payload` writes it; slots are handed out as far as they go, never waited for."""

from __future__ import annotations

import torch

from services.worker.attention.reference import write_kv
from services.worker.kv_offload.payload import PayloadHeader, check_payload, pack_payload
from services.worker.kv_offload.staging import StagingPool, gather_blocks, scatter_blocks

HEADER = PayloadHeader("tiny", torch.float32, (3, 2, 4, 2, 8))


def test_gather_then_scatter_moves_blocks_to_other_ids() -> None:
    torch.manual_seed(0)
    layers = [torch.randn(2, 10, 4, 2, 8) for _ in range(3)]
    pool = StagingPool(HEADER, num_slots=4, pinned=False)
    slots = pool.acquire(2)
    assert len(slots) == 2
    assert gather_blocks(layers, [7, 2], pool, slots) is None  # CPU: complete on return
    chunks = pool.bodies[slots]
    assert torch.equal(chunks[0, 1], layers[1][:, 7]) and torch.equal(chunks[1, 2], layers[2][:, 2])
    before = [layer.clone() for layer in layers]
    scatter_blocks(layers, [0, 9], chunks, write_kv)
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[:, 0], old[:, 7]) and torch.equal(layer[:, 9], old[:, 2])
        assert torch.equal(layer[:, 1:9], old[:, 1:9])  # nothing else touched


def test_a_slot_payload_is_the_packed_chunk_with_an_aligned_body() -> None:
    layers = [torch.randn(2, 10, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    header = PayloadHeader("a-model-name", torch.bfloat16, (3, 2, 4, 2, 8))
    pool = StagingPool(header, num_slots=2, pinned=False)
    gather_blocks(layers, [5, 6], pool, [1, 0])
    for slot, block in ((1, 5), (0, 6)):
        body = torch.stack([layer[:, block] for layer in layers]).contiguous()
        payload = pool.payload(slot)
        assert bytes(payload) == pack_payload(header, body)
        assert check_payload(bytes(payload), header) == len(header.encode())
        assert pool.bodies[slot].data_ptr() % 64 == 0
    assert pool.payload_bytes == len(header.encode()) + header.body_bytes


def test_slots_are_handed_out_as_far_as_they_go_and_reused() -> None:
    slot = len(HEADER.encode()) + HEADER.body_bytes + 64
    pool = StagingPool.sized(HEADER, budget_bytes=3 * slot, pinned=False)
    assert pool.num_slots == 3
    first = pool.acquire(2)
    assert len(first) == 2 and pool.acquire(2) == [first[-1] + 1] and pool.num_free == 0
    assert pool.acquire(1) == []
    pool.release(first)
    assert sorted(pool.acquire(5)) == sorted(first)
    assert StagingPool.sized(HEADER, 1, pinned=False).num_slots == 1
