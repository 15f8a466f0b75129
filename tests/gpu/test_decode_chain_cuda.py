"""The decode chain (services/worker/accel/decode_chain.py) on the GPU: bit-identical to the
layer-by-layer Triton forward in bf16 (hidden states and the KV cache it writes), eagerly and
inside a CUDA graph, and what the model's forward runs for steps of 1..16 rows."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.accel.decode_chain import DecodeChain, fused_attention_takes
from services.worker.attention.select import build_attention_metadata
from services.worker.models.random_init import build_random_model
from services.worker.runner.kv_cache import KVCache

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}
BLOCK = 16


def _step(rows: int):  # type: ignore[no-untyped-def]
    lens = np.array([40 + (23 * r) % 450 for r in range(rows)])  # below max_position_embeddings
    width = int(lens.max()) // BLOCK + 1
    tables = np.arange(rows * width).reshape(rows, width)
    positions = lens - 1
    slots = tables[np.arange(rows), positions // BLOCK] * BLOCK + positions % BLOCK
    meta = build_attention_metadata(
        query_lens=np.ones(rows, dtype=np.int64), seq_lens=lens, block_tables=tables,
        block_size=BLOCK, slot_mapping=slots, num_kv_heads=2, device="cuda",
        backend=TritonPagedAttention(),
    )  # fmt: skip
    ids = torch.arange(rows, device="cuda") * 37 % 1000
    return ids, torch.as_tensor(positions, device="cuda"), meta


@pytest.mark.parametrize(("rows", "splits"), [(1, None), (5, None), (16, None), (1, 16), (2, 7)])
def test_chain_is_bit_identical_to_the_layer_by_layer_forward(
    rows: int, splits: int | None
) -> None:
    """splits: the decode split count forced (the graphs' choice from max_model_len), so the
    chain's attention runs from the qkv partials in one kernel
    (meshllm_kernels/decode_chain/decode_from_qkv.py); rows=5 gets there by itself (3 strided pieces
    at 2 kv heads)."""
    # On CUDA the model is built with the Triton layers, and the loader gives it the chain.
    model, config = build_random_model(SHAPE, torch.bfloat16, "cuda", std=0.05, seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    chain = model.decode_chain
    assert isinstance(chain, DecodeChain) and chain.takes(torch.zeros(rows, device="cuda"))
    cache = KVCache.allocate(config, rows * 32, BLOCK, torch.bfloat16, "cuda")
    for layer_cache in cache.layers:
        layer_cache.normal_()
    other = copy.deepcopy(cache)
    ids, positions, meta = _step(rows)
    if splits is not None:
        meta = dataclasses.replace(meta, decode_num_splits=splits)
    assert fused_attention_takes(model, meta, rows) == (splits is not None or rows == 5)
    with torch.inference_mode():
        fused = model(ids, positions, meta, cache.layers)
        model.decode_chain = None  # the same layers, one by one
        plain = model(ids, positions, meta, other.layers)
        model.decode_chain = chain
        assert torch.equal(fused, plain)
        for a, b in zip(cache.layers, other.layers, strict=True):
            assert torch.equal(a, b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(ids, positions, meta, cache.layers)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, plain)


@pytest.mark.parametrize("rows", [17, 40, 64, 96])
def test_past_16_rows_the_chain_is_bit_identical_where_the_worker_routes_it(rows: int) -> None:
    """settings.gemv_max_rows raised (cuda_layers.set_gemv_max_rows): the GEMV at 17-128 rows
    (BLOCK_M the next power of two) through the chain equals the layer-by-layer Triton forward
    bit for bit, and each row is within bf16 rounding of the cuBLAS forward it replaces."""
    from services.worker.accel import cuda_layers

    model, config = build_random_model(SHAPE, torch.bfloat16, "cuda", std=0.05, seed=1)
    chain = model.decode_chain
    assert isinstance(chain, DecodeChain)
    cache = KVCache.allocate(config, rows * 32, BLOCK, torch.bfloat16, "cuda")
    for layer_cache in cache.layers:
        layer_cache.normal_()
    caches = [copy.deepcopy(cache) for _ in range(3)]
    ids, positions, meta = _step(rows)
    try:
        cuda_layers.set_gemv_max_rows(128)
        assert chain.takes(ids)
        with torch.inference_mode():
            fused = model(ids, positions, meta, caches[0].layers)
            model.decode_chain = None
            plain = model(ids, positions, meta, caches[1].layers)
            cuda_layers.set_gemv_max_rows(cuda_layers.GEMV_MAX_ROWS)  # cuBLAS past 16 rows
            cublas = model(ids, positions, meta, caches[2].layers)
    finally:
        model.decode_chain = chain
        cuda_layers.set_gemv_max_rows(cuda_layers.GEMV_MAX_ROWS)
    assert torch.equal(fused, plain)
    torch.testing.assert_close(fused.float(), cublas.float(), rtol=5e-2, atol=5e-2)
