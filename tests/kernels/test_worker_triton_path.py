"""The worker's CUDA attention path (attention_select + cuda_graphs padding) against its CPU
path, run here through Triton's interpreter on a tiny fp32 Llama.

Both paths run the same steps over two copies of the KV cache: the hidden states and the cache
contents must agree. This is the logic the GPU runs (fused RoPE insert, decode/prefill split,
host-computed lengths, padded graph rows); tests/gpu runs it compiled on the H200.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.accel.cuda_graphs import DecodeGraphs
from services.worker.accel.prefill_graphs import PrefillGraphs
from services.worker.accel.verify_graphs import VerifyGraphs
from services.worker.attention.backend_choice import resolve_backend
from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata, build_attention_metadata
from services.worker.models.layer_impls import REFERENCE
from services.worker.models.random_init import build_random_model
from services.worker.runner.kv_cache import KVCache
from shared.kv.groups import kv_groups_for

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}
BLOCK = 4


@pytest.fixture
def model(device: torch.device) -> torch.nn.Module:
    # The reference layers on every device: what differs between the paths is the attention.
    built, _ = build_random_model(TINY, torch.float32, device, std=0.2, seed=3, impls=REFERENCE)
    return built


def _caches(model: torch.nn.Module) -> tuple[KVCache, KVCache]:
    device = model.embed_tokens.weight.device
    return tuple(  # type: ignore[return-value]
        KVCache.allocate(model.config, 32, BLOCK, torch.float32, device) for _ in range(2)
    )


def _step(model, cache, meta_cls, query_lens, seq_lens, tables, tokens, dense=None, backend=None):  # type: ignore[no-untyped-def]
    """One flat-batch forward; positions/slots derived from the lengths like the runner does."""
    query_lens, seq_lens = np.array(query_lens), np.array(seq_lens)
    starts = seq_lens - query_lens
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, seq_lens, strict=True)])
    rows = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    device = model.embed_tokens.weight.device
    kwargs = dict(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, block_size=BLOCK,
        slot_mapping=slots, device=device,
    )  # fmt: skip
    if meta_cls is TritonAttentionMetadata:
        meta = TritonAttentionMetadata.build(
            num_kv_heads=2, backend=backend or TritonPagedAttention(), dense_impl=dense, **kwargs
        )
    else:
        meta = AttentionMetadata.build(**kwargs)
    with torch.inference_mode():
        ids, pos = torch.tensor(tokens, device=device), torch.from_numpy(positions).to(device)
        return model(ids, pos, meta, cache.layers)


def test_the_reference_backend_selects_the_reference_path() -> None:
    backend = resolve_backend("cpu", kv_groups_for([None, None]), torch.float32)
    meta = build_attention_metadata(
        query_lens=np.array([1]), seq_lens=np.array([3]), block_tables=np.array([[1]]),
        block_size=BLOCK, slot_mapping=np.array([6]), num_kv_heads=2, backend=backend,
        device="cpu",
    )  # fmt: skip
    assert isinstance(meta, AttentionMetadata)


class RecordingTriton(TritonPagedAttention):
    """The Triton backend, recording each call of its entry points (kind, causal flag)."""

    name = "recording_triton"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []
        prefill, decode = self.prefill, self.decode

        def recorded_prefill(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls.append(("prefill", kwargs["causal"]))
            return prefill(*args, **kwargs)

        def recorded_decode(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls.append(("decode", True))
            return decode(*args, **kwargs)

        self.prefill, self.decode = recorded_prefill, recorded_decode


def test_the_step_attends_through_its_backends_entry_points(model: torch.nn.Module) -> None:
    """Every layer's paged attention is a call of the metadata's backend (2 layers: a decode
    and a causal prefill each), and the result is the reference path's."""
    ref, tri = _caches(model)
    tables = np.array([[1, 2, 3, 0], [4, 5, 0, 0]])
    tokens = np.random.default_rng(2).integers(0, 128, 12).tolist()
    _step(model, ref, AttentionMetadata, [6, 4], [6, 4], tables, tokens[:10])
    _step(model, tri, AttentionMetadata, [6, 4], [6, 4], tables, tokens[:10])
    backend = RecordingTriton()
    a = _step(model, ref, AttentionMetadata, [1, 1], [7, 5], tables, tokens[10:])
    b = _step(model, tri, TritonAttentionMetadata, [1, 1], [7, 5], tables, tokens[10:], None,
              backend)  # fmt: skip
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert backend.calls == [("decode", True)] * 2
    backend.calls.clear()
    a = _step(model, ref, AttentionMetadata, [1, 3], [8, 8], tables, [5, 6, 7, 8])
    b = _step(model, tri, TritonAttentionMetadata, [1, 3], [8, 8], tables, [5, 6, 7, 8], None,
              backend)  # fmt: skip
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert backend.calls == [("decode", True), ("prefill", True)] * 2


@pytest.mark.parametrize("dense", [None, "sdpa"])
def test_triton_path_matches_reference_on_mixed_steps(
    model: torch.nn.Module, dense: str | None
) -> None:
    """dense=None: every prefill span on the paged kernel (no dense implementation runs on
    CPU/fp32); "sdpa": fresh spans through dense attention over the cache rows just written,
    the others paged, as on the GPU in bf16."""
    ref, tri = _caches(model)
    tables = np.array(
        [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [10, 11, 12, 0], [13, 14, 0, 0], [15, 16, 0, 0]]
    )
    gen = np.random.default_rng(0)

    def both(q_lens: list[int], seq_lens: list[int], order: np.ndarray) -> None:
        tokens = gen.integers(0, 128, sum(q_lens)).tolist()
        a = _step(model, ref, AttentionMetadata, q_lens, seq_lens, order, tokens)
        b = _step(model, tri, TritonAttentionMetadata, q_lens, seq_lens, order, tokens, dense)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)

    # Step 1: three prefills from scratch (lengths 9, 5, 4).
    both([9, 5, 4], [9, 5, 4], tables[:3])
    # Step 2: two decodes (contexts 9 and 5), an extend of 3 tokens onto 4, a new prefill of 6.
    both([1, 1, 3, 6], [10, 6, 7, 6], tables[[0, 1, 2, 3]])
    # Step 3: a decode, then fresh 3, an extend of 2 onto 6, fresh 2: the fresh rows are not
    # contiguous (gathered and scattered by index).
    both([1, 3, 2, 2], [11, 3, 8, 2], tables[[0, 4, 3, 5]])
    for layer_ref, layer_tri in zip(ref.layers, tri.layers, strict=True):
        torch.testing.assert_close(layer_tri, layer_ref, rtol=1e-5, atol=1e-5)


def test_padded_graph_rows_leave_real_rows_and_cache_unchanged(model: torch.nn.Module) -> None:
    ref, tri = _caches(model)
    tables = np.array([[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0]])
    lens = [6, 3, 7]
    tokens = np.random.default_rng(1).integers(0, 128, sum(lens)).tolist()
    _step(model, ref, AttentionMetadata, lens, lens, tables, tokens)
    _step(model, tri, AttentionMetadata, lens, lens, tables, tokens)
    # One decode step of the 3 requests: eager reference vs the graph's padded inputs (size 4).
    seq_lens = np.array(lens) + 1
    positions = seq_lens - 1
    slots = tables[np.arange(3), positions // BLOCK] * BLOCK + positions % BLOCK
    new = [7, 8, 9]
    a = _step(model, ref, AttentionMetadata, [1, 1, 1], seq_lens, tables, new)
    device = model.embed_tokens.weight.device
    graphs = DecodeGraphs(
        model,
        tri.layers,
        TritonPagedAttention(),
        max_num_reqs=4,
        max_blocks_per_req=4,
        max_model_len=16,
        device=device,
    )
    assert graphs.sizes == (1, 2, 4)
    graphs._stage(3, 4, np.array(new), positions, slots, seq_lens, tables)
    assert graphs.static["slots"][3].item() == -1 and graphs.static["seq_lens"][3].item() == 1
    with torch.inference_mode():
        b = graphs.forward(4, graphs.metadata(4))
    assert b.shape[0] == 4
    torch.testing.assert_close(b[:3], a, rtol=1e-4, atol=1e-4)
    for layer_ref, layer_tri in zip(ref.layers, tri.layers, strict=True):
        torch.testing.assert_close(layer_tri, layer_ref, rtol=1e-5, atol=1e-5)


def test_padded_verify_rows_leave_real_rows_and_cache_unchanged(model: torch.nn.Module) -> None:
    """A verify step (1 + d tokens per request, d <= k = 3) run as the verify graph runs it:
    each request padded to 4 tokens and the batch to 4 requests, one paged-prefill span each.
    The real rows, gathered back, and the cache equal the eager reference step."""
    ref, tri = _caches(model)
    tables = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 0]])
    lens = [5, 4, 7]
    tokens = np.random.default_rng(2).integers(0, 128, sum(lens)).tolist()
    _step(model, ref, AttentionMetadata, lens, lens, tables, tokens)
    _step(model, tri, AttentionMetadata, lens, lens, tables, tokens)
    query_lens = np.array([3, 1, 4])  # 2 drafts, none, 3 drafts (the full width)
    seq_lens = np.array(lens) + query_lens
    new = np.random.default_rng(3).integers(0, 128, int(query_lens.sum()))
    a = _step(model, ref, AttentionMetadata, query_lens, seq_lens, tables, new.tolist())
    starts = seq_lens - query_lens
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, seq_lens, strict=True)])
    rows = np.repeat(np.arange(3), query_lens)
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    device = model.embed_tokens.weight.device
    graphs = VerifyGraphs(
        model, tri.layers, TritonPagedAttention(), num_spec_tokens=3, max_num_reqs=4,
        max_blocks_per_req=4, block_size=BLOCK, device=device,
    )  # fmt: skip
    graphs.graphs = dict.fromkeys(graphs.sizes)  # type: ignore[arg-type]  (captured on CUDA)
    layout = graphs.layout(query_lens, seq_lens, new, positions, slots)
    assert layout is not None and layout.size == 4
    graphs.stage(layout, tables)
    assert graphs.static["slots"][3:4].tolist() == [-1]  # request 0's pad row writes no KV
    assert graphs.static["seq_lens"].tolist() == [9, 8, 11, 4]  # + pads; a pad request: 4 keys
    with torch.inference_mode():
        b = graphs.forward(4, graphs.metadata(4))
    assert b.shape[0] == 16
    torch.testing.assert_close(b[torch.from_numpy(layout.gather)], a, rtol=1e-4, atol=1e-4)
    for layer_ref, layer_tri in zip(ref.layers, tri.layers, strict=True):
        torch.testing.assert_close(layer_tri, layer_ref, rtol=1e-5, atol=1e-5)


def test_padded_prefill_rows_leave_real_rows_and_cache_unchanged(model: torch.nn.Module) -> None:
    """A mixed step (a decode, a chunk extending a cached prefix, a fresh prompt) run as the
    prefill graph runs it: padded to 16 tokens by a pad sequence, every request one
    paged-prefill span. The real rows and the cache equal the eager reference step."""
    ref, tri = _caches(model)
    tables = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 0, 0]])
    lens = [7, 3]
    tokens = np.random.default_rng(4).integers(0, 128, sum(lens)).tolist()
    _step(model, ref, AttentionMetadata, lens, lens, tables[:2], tokens)
    _step(model, tri, AttentionMetadata, lens, lens, tables[:2], tokens)
    query_lens = np.array([1, 4, 5])  # a decode, 4 tokens onto 3 cached, a fresh prompt of 5
    seq_lens = np.array([8, 7, 5])
    new = np.random.default_rng(5).integers(0, 128, int(query_lens.sum()))
    a = _step(model, ref, AttentionMetadata, query_lens, seq_lens, tables, new.tolist())
    starts = seq_lens - query_lens
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, seq_lens, strict=True)])
    rows = np.repeat(np.arange(3), query_lens)
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    graphs = PrefillGraphs(
        model, tri.layers, TritonPagedAttention(), max_tokens=16, max_num_reqs=4,
        max_blocks_per_req=4, block_size=BLOCK, device=model.embed_tokens.weight.device,
    )  # fmt: skip
    graphs.graphs = dict.fromkeys(graphs.sizes)  # type: ignore[arg-type]  (captured on CUDA)
    layout = graphs.layout(query_lens, seq_lens, new, positions, slots)
    assert layout is not None and layout.size == 16
    graphs.stage(layout, tables)
    assert graphs.static["slots"][10:].tolist() == [-1] * 6  # the pad writes no KV
    assert graphs.static["seq_lens"].tolist() == [8, 7, 5, 6, 0]  # the pad: its own 6 keys
    with torch.inference_mode():
        b = graphs.forward(16, graphs.metadata(16))
    assert b.shape[0] == 16
    torch.testing.assert_close(b[:10], a, rtol=1e-4, atol=1e-4)
    for layer_ref, layer_tri in zip(ref.layers, tri.layers, strict=True):
        torch.testing.assert_close(layer_tri, layer_ref, rtol=1e-5, atol=1e-5)


def test_gemv_limits_restated_in_cuda_layers_match_the_kernel() -> None:
    from meshllm_kernels.decode_chain import gemv
    from services.worker.accel import cuda_layers

    assert cuda_layers.GEMV_KERNEL_MAX_ROWS == gemv.MAX_BATCH
    assert cuda_layers.GEMV_MAX_ROWS == gemv.TUNED_BATCH  # the default: the tuned batches
    assert cuda_layers.GEMV_DTYPES == gemv.WEIGHT_DTYPES
