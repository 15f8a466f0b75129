"""The decode chain (services/worker/accel/decode_chain.py) against the layer-by-layer forward.

On CPU the Triton kernels run in the interpreter and the layer-by-layer forward in PyTorch, so
the two agree to fp32 rounding; tests/gpu/test_decode_chain_cuda.py checks bit-identity against
the layer-by-layer Triton forward on the GPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.accel.cuda_layers import TRITON
from services.worker.accel.decode_chain import DecodeChain, chain_fits, chain_forward
from services.worker.attention.select import build_attention_metadata
from services.worker.models.layer_impls import REFERENCE
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.random_init import build_random_model
from services.worker.runner.kv_cache import KVCache

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}
BLOCK = 4


def _model(device: torch.device, **overrides: object) -> LlamaForCausalLM:
    # compiled=True: the checkpoint's [out, in] weight layout on CPU too (as on CUDA).
    model, _ = build_random_model(
        dict(TINY, **overrides), torch.float32, device, std=0.2, seed=5, compiled=True,
        impls=TRITON,
    )  # fmt: skip
    with torch.no_grad():  # norm scales of their own, so using the wrong norm shows
        generator = torch.Generator(device).manual_seed(2)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=generator)
    return model  # type: ignore[return-value]


def _decode_step(model: LlamaForCausalLM, cache: KVCache, seq_lens: list[int]):  # type: ignore[no-untyped-def]
    """A decode step of len(seq_lens) rows over a cache prefilled by the same model."""
    device = model.embed_tokens.weight.device
    rows = len(seq_lens)
    tables = np.arange(rows * 4).reshape(rows, 4)
    lens = np.array(seq_lens)
    positions = lens - 1
    slots = tables[np.arange(rows), positions // BLOCK] * BLOCK + positions % BLOCK
    meta = build_attention_metadata(
        query_lens=np.ones(rows, dtype=np.int64), seq_lens=lens, block_tables=tables,
        block_size=BLOCK, slot_mapping=slots, num_kv_heads=2, device=device,
        backend=TritonPagedAttention(),
    )  # fmt: skip
    ids = torch.tensor([(7 * r + 3) % 128 for r in range(rows)], device=device)
    return ids, torch.as_tensor(positions, device=device), meta


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_chain_matches_layer_by_layer(device, rows) -> None:  # type: ignore[no-untyped-def]
    model = _model(device)
    assert isinstance(model.decode_chain, DecodeChain)
    cache = KVCache.allocate(model.config, rows * 4, BLOCK, torch.float32, device)
    for layer_cache in cache.layers:  # an earlier context, the same in both runs
        layer_cache.normal_(0, 1, generator=torch.Generator(device).manual_seed(1))
    other = copy.deepcopy(cache)
    lens = [[9, 14, 5, 11, 7][r % 5] for r in range(rows)]
    ids, positions, meta = _decode_step(model, cache, lens)
    with torch.inference_mode():
        fused = chain_forward(model, ids, positions, meta, cache.layers)
        model.decode_chain = None  # the same model, layer by layer
        plain = model(ids, positions, meta, other.layers)
    assert fused.shape == plain.shape == (rows, 64)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache.layers, other.layers, strict=True):  # the step's K/V written alike
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chain_is_the_models_forward_on_the_steps_it_takes(device) -> None:  # type: ignore[no-untyped-def]
    """forward hands a step to the decode chain exactly when the chain takes it: on CUDA, 1..16
    rows by default; the rest (CPU tensors here, 17 rows) runs layer by layer."""
    model = _model(device)
    chain = model.decode_chain
    assert chain is not None
    calls: list[int] = []
    real = chain.forward
    chain.forward = lambda ids, *a: calls.append(ids.shape[0]) or real(ids, *a)  # type: ignore[method-assign]
    cache = KVCache.allocate(model.config, 17 * 4, BLOCK, torch.float32, device)
    for rows in (1, 16, 17):
        ids, positions, meta = _decode_step(model, cache, [4 + r % 9 for r in range(rows)])
        with torch.inference_mode():
            model(ids, positions, meta, cache.layers)
    assert calls == ([1, 16] if device.type == "cuda" else [])
    assert chain.takes(ids[:16]) == (device.type == "cuda") and not chain.takes(ids)
    assert chain.reads_fed_ids(16) and not chain.reads_fed_ids(17)


def test_the_worker_may_route_more_rows_to_the_chain(device) -> None:  # type: ignore[no-untyped-def]
    """settings.gemv_max_rows (cuda_layers.set_gemv_max_rows): steps up to that many rows run
    the chain and the GEMV, the graphs of those sizes read fed ids from the chain."""
    from services.worker.accel import cuda_layers

    model = _model(device)
    chain = model.decode_chain
    assert chain is not None
    cache = KVCache.allocate(model.config, 40 * 4, BLOCK, torch.float32, device)
    ids, _, _ = _decode_step(model, cache, [4 + r % 9 for r in range(40)])
    cuda = device.type == "cuda"
    try:
        cuda_layers.set_gemv_max_rows(32)
        assert chain.takes(ids[:32]) == cuda and not chain.takes(ids[:33])
        assert chain.reads_fed_ids(32) and not chain.reads_fed_ids(33)
        x = torch.randn(32, 64, device=device)
        assert cuda_layers._gemv_rows(x, x.new_empty(8, 64)) == cuda
        assert not cuda_layers._gemv_rows(torch.cat([x, x[:1]]), x.new_empty(8, 64))
        with pytest.raises(ValueError, match=r"1\.\.128"):
            cuda_layers.set_gemv_max_rows(129)
    finally:
        cuda_layers.set_gemv_max_rows(cuda_layers.GEMV_MAX_ROWS)
    assert cuda_layers.gemv_max_rows() == 16 and not chain.reads_fed_ids(17)


def test_fits_only_the_structure_it_runs(device) -> None:  # type: ignore[no-untyped-def]
    assert chain_fits(_model(device))
    biased = _model(device, attention_bias=True)  # o_proj with a bias: not taken
    assert type(biased) is LlamaForCausalLM and not chain_fits(biased)
    assert biased.decode_chain is None
    gelu = _model(device, hidden_act="gelu_pytorch_tanh")
    assert type(gelu) is LlamaForCausalLM and gelu.decode_chain is None
    plain, _ = build_random_model(
        TINY, torch.float32, device, std=0.2, seed=5, compiled=True, impls=REFERENCE
    )
    assert not chain_fits(plain) and plain.decode_chain is None  # the reference layers
    gemma, _ = build_random_model(
        dict(TINY, architectures=["Gemma3ForCausalLM"], hidden_act="gelu_pytorch_tanh"),
        torch.float32, device, compiled=True, impls=TRITON,
    )  # fmt: skip
    assert gemma.decode_chain is None  # a family of its own (embedding scale, four norms)


def test_chain_attention_from_qkv_partials_matches_layer_by_layer(device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Triton metadata with the strided split-K decode: the chain runs each layer's attention
    from the qkv partials in one kernel (meshllm_kernels/decode_chain/decode_from_qkv.py)."""
    import dataclasses

    from meshllm_kernels.attention.paged_decode import STRIDED_MIN_SPLITS
    from meshllm_kernels.decode_chain import decode_from_qkv as fused_module
    from services.worker.accel import decode_chain
    from services.worker.attention.select import TritonAttentionMetadata

    calls = []
    real = fused_module.decode_from_qkv
    monkeypatch.setattr(
        fused_module, "decode_from_qkv", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    model = _model(device)
    cache = KVCache.allocate(model.config, 2 * 4, BLOCK, torch.float32, device)
    for layer_cache in cache.layers:
        layer_cache.normal_(0, 1, generator=torch.Generator(device).manual_seed(1))
    other = copy.deepcopy(cache)
    lens, tables = np.array([9, 14]), np.arange(8).reshape(2, 4)
    positions = lens - 1
    slots = tables[[0, 1], positions // BLOCK] * BLOCK + positions % BLOCK
    meta = TritonAttentionMetadata.build(
        query_lens=np.ones(2, dtype=np.int64), seq_lens=lens, block_tables=tables,
        block_size=BLOCK, slot_mapping=slots,
        num_kv_heads=2, device=device, backend=TritonPagedAttention(),
    )  # fmt: skip
    meta = dataclasses.replace(meta, decode_num_splits=STRIDED_MIN_SPLITS)  # the strided kernel
    ids, pos = torch.tensor([3, 10], device=device), torch.as_tensor(positions, device=device)
    assert decode_chain.fused_attention_takes(model, meta, 2)
    with torch.inference_mode():
        fused = chain_forward(model, ids, pos, meta, cache.layers)
        assert len(calls) == TINY["num_hidden_layers"]
        model.decode_chain = None  # the same model, layer by layer
        plain = model(ids, pos, dataclasses.replace(meta), other.layers)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache.layers, other.layers, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # Steps it does not take: a window, a non-decode row, a split count of one.
    assert not decode_chain.fused_attention_takes(
        model, dataclasses.replace(meta, sliding_window=4), 2
    )
    assert not decode_chain.fused_attention_takes(model, meta, 3)
    assert not decode_chain.fused_attention_takes(
        model, dataclasses.replace(meta, decode_num_splits=1), 2
    )


def test_fed_ids_read_from_the_feed_table_equal_the_tokens_themselves(device) -> None:  # type: ignore[no-untyped-def]
    """In a decode graph the chain's first kernel reads an id -(row + 1) from the feed table
    (TritonAttentionMetadata.fed_tokens): the same step, bit for bit, as the tokens given."""
    import dataclasses

    from services.worker.attention.select import TritonAttentionMetadata
    from services.worker.runner.in_flight import fed_id

    model = _model(device)
    cache = KVCache.allocate(model.config, 2 * 4, BLOCK, torch.float32, device)
    other = copy.deepcopy(cache)
    lens, tables = np.array([9, 14]), np.arange(8).reshape(2, 4)
    positions = lens - 1
    meta = TritonAttentionMetadata.build(
        query_lens=np.ones(2, dtype=np.int64), seq_lens=lens, block_tables=tables,
        block_size=BLOCK, slot_mapping=tables[[0, 1], positions // BLOCK] * BLOCK
        + positions % BLOCK, num_kv_heads=2, device=device, backend=TritonPagedAttention(),
    )  # fmt: skip
    pos = torch.as_tensor(positions, device=device)
    latest = torch.tensor([0, 0, 0, 77], device=device)
    fed = torch.tensor([5, fed_id(3)], device=device)
    with torch.inference_mode():
        got = chain_forward(
            model, fed, pos, dataclasses.replace(meta, fed_tokens=latest), cache.layers
        )
        want = chain_forward(model, torch.tensor([5, 77], device=device), pos, meta, other.layers)
    assert torch.equal(got, want)
    assert fed.tolist() == [5, fed_id(3)]  # the graph's input is read, not rewritten
