"""Loaded KV goes into the paged cache through the KV-only insert kernel (no rotation): the
blocks a load writes hold exactly the bytes that were stored, for every cache dtype the worker
allocates, through the connector's own staging helpers (services/worker/kv_offload/staging.py,
services/worker/attention/context_kv.py)."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.context_kv import context_kv_writer, kernel_insert
from services.worker.attention.reference import write_kv
from services.worker.kv_offload.payload import PayloadHeader
from services.worker.kv_offload.staging import StagingPool, gather_blocks, scatter_blocks

LAYERS, BLOCKS, PAGE, KV_HEADS, HEAD_DIM = 3, 12, 4, 2, 16


def _cache(dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, PAGE, KV_HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(LAYERS)]


def _stored(layers: list[torch.Tensor], blocks: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Blocks as a store stages them: [n, layers, 2, page, kv_heads, head_dim] (the payload
    bodies), on the cache's device as a load uploads them."""
    header = PayloadHeader("tiny", dtype, (LAYERS, 2, PAGE, KV_HEADS, HEAD_DIM))
    pool = StagingPool(header, num_slots=len(blocks), pinned=False)
    slots = pool.acquire(len(blocks))
    fence = gather_blocks(layers, blocks, pool, slots)
    if fence is not None:
        fence.synchronize()
    return pool.bodies[slots].to(layers[0].device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_loaded_blocks_equal_the_stored_ones(
    device: torch.device, dtype: torch.dtype, num_chunks: int
) -> None:
    source = _cache(dtype, device, seed=1)
    stored_ids, loaded_ids = [7, 2, 5][:num_chunks], [1, 10, 4][:num_chunks]
    chunks = _stored(source, stored_ids, dtype)
    target = _cache(dtype, device, seed=2)
    before = [layer.clone() for layer in target]
    scatter_blocks(target, loaded_ids, chunks, kernel_insert)
    untouched = [b for b in range(BLOCKS) if b not in loaded_ids]
    for src, dst, old in zip(source, target, before, strict=True):
        for s, d in zip(stored_ids, loaded_ids, strict=True):  # bit for bit: no rotation
            assert torch.equal(dst[:, d].view(torch.uint8), src[:, s].view(torch.uint8))
        assert torch.equal(dst[:, untouched], old[:, untouched])
    # The CPU writer (the reference path's write_kv) leaves the same bytes.
    on_cpu = [layer.cpu() for layer in before]
    scatter_blocks(on_cpu, loaded_ids, chunks.cpu(), write_kv)
    for cpu, dst in zip(on_cpu, target, strict=True):
        assert torch.equal(cpu.view(torch.uint8), dst.cpu().view(torch.uint8))


def test_a_cache_with_padded_blocks_is_addressed_by_its_strides(device: torch.device) -> None:
    """A layer that is a view into a larger allocation (block stride > one block's records)."""
    source = _cache(torch.float32, device, seed=3)
    chunks = _stored(source, [3], torch.float32)
    padded = torch.zeros(2, BLOCKS, PAGE + 1, KV_HEADS, HEAD_DIM, device=device)
    view = padded[:, :, :PAGE]
    scatter_blocks([view, *_cache(torch.float32, device, 4)[1:]], [6], chunks, kernel_insert)
    assert torch.equal(view[:, 6], source[0][:, 3])
    assert not padded[:, :, PAGE].any()  # the padding slot of every block is never written


def test_the_connector_writes_with_the_kernel_on_cuda_only() -> None:
    assert context_kv_writer("cuda") is kernel_insert
    assert context_kv_writer("cpu") is write_kv


def test_an_fp8_cache_is_refused_not_written_unscaled(device: torch.device) -> None:
    """Loaded fp8 K/V would need its scales: the kernel's input checks refuse it."""
    cache = torch.zeros(2, BLOCKS, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn)
    chunks = torch.zeros(1, 1, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn)
    with pytest.raises((TypeError, ValueError)):
        scatter_blocks([cache.to(device)], [1], chunks.to(device), kernel_insert)
