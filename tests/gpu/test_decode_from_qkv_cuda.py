"""Decode attention from the qkv partials (meshllm_kernels/decode_chain/decode_from_qkv.py) at the
Llama-3-8B attention shape on the GPU: bit-identical to the three launches it replaces (split-K
reduce, RoPE + KV insert, strided decode), launch after launch (a race between the piece that writes
the new token and the pieces that read would show as a difference in some launch), eagerly
and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention.kv_insert import insert_qkv
from meshllm_kernels.attention.paged_decode import paged_decode_attention
from meshllm_kernels.decode_chain.decode_from_qkv import decode_from_qkv
from meshllm_kernels.decode_chain.gemv import gemv, gemv_partials
from tests.kernels.rope_cache import cos_sin_cache

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, PAGE = 32, 8, 128, 4096, 16
WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM


@pytest.mark.parametrize(("rows", "context", "splits"), [(1, 640, 16), (1, 4097, 16), (2, 300, 7)])
def test_bit_identical_to_the_three_launches_at_8b_shape(rows, context, splits) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator("cuda").manual_seed(0)
    blocks = rows * (context // PAGE + 2)
    cache = torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    cache = cache.to(torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    tables = tables.view(rows, -1).contiguous()
    lens = torch.tensor([context - 37 * r for r in range(rows)], dtype=torch.int32, device="cuda")
    last = lens.long() - 1
    slots = tables.gather(1, (last // PAGE)[:, None]).squeeze(1).long() * PAGE + last % PAGE
    table = cos_sin_cache(context, HEAD_DIM, torch.device("cuda")).to(torch.bfloat16)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(WIDTH, HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)

    def three(c: torch.Tensor) -> torch.Tensor:
        qkv = gemv(x, weight)
        q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, -1)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(rows, KV_HEADS, HEAD_DIM)
        q_rot = insert_qkv(q, k, v, c, slots, last, table)
        return paged_decode_attention(q_rot, c, tables, lens, num_splits=splits, strided=True)

    def fused(c: torch.Tensor) -> torch.Tensor:
        part = gemv_partials(x, weight)
        return decode_from_qkv(
            part, c, tables, lens, slots, last, table, num_heads=HEADS, num_splits=splits,
            dtype=torch.bfloat16,
        )  # fmt: skip

    want_cache = cache.clone()
    want = three(want_cache)
    got_cache = cache.clone()
    for _ in range(20):
        got_cache.copy_(cache)
        got = fused(got_cache)
        assert torch.equal(got_cache, want_cache)
        assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused(got_cache)
    for _ in range(5):
        got_cache.copy_(cache)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got_cache, want_cache)
        assert torch.equal(captured, want)
