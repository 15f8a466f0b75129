"""Graph size selection and padding of decode steps (pure host logic, runs on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.accel.cuda_graphs import GRAPH_SIZES, DecodeGraphs, graph_sizes, padded_size
from services.worker.models.random_init import build_random_model
from services.worker.runner.kv_cache import KVCache
from tests.support.tiny_llama import RANDOM_TINY_LLAMA


def test_graph_sizes_cover_every_batch_up_to_the_maximum() -> None:
    assert graph_sizes(256) == GRAPH_SIZES
    assert graph_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_sizes(48) == (1, 2, 4, 8, 16, 32, 48)  # a full batch never runs eagerly
    with pytest.raises(ValueError):
        graph_sizes(0)
    sizes = graph_sizes(48)
    for n in range(1, 49):
        size = padded_size(n, sizes)
        assert size is not None and size >= n
        smaller = [s for s in sizes if s < size]
        assert not smaller or smaller[-1] < n  # the smallest size that holds n
    assert padded_size(49, sizes) is None and padded_size(0, sizes) is None


def _graphs(max_num_reqs: int = 6) -> DecodeGraphs:
    model, config = build_random_model(RANDOM_TINY_LLAMA, torch.float32, "cpu")
    kv = KVCache.allocate(config, 16, 4, torch.float32, "cpu")
    return DecodeGraphs(
        model, kv.layers, TritonPagedAttention(), max_num_reqs=max_num_reqs, max_blocks_per_req=5,
        max_model_len=20,
        device="cpu",
    )  # fmt: skip


def test_staging_writes_real_rows_and_pads_the_rest() -> None:
    graphs = _graphs()
    assert graphs.sizes == (1, 2, 4, 6)
    tables = np.array([[3, 4, 0, 0, 0], [5, 6, 7, 0, 0], [8, 0, 0, 0, 0]])
    graphs._stage(
        3, 4, np.array([11, 12, 13]), np.array([5, 9, 2]), np.array([13, 25, 34]),
        np.array([6, 10, 3]), tables,
    )  # fmt: skip
    assert graphs.static["input_ids"][:4].tolist() == [11, 12, 13, 0]
    assert graphs.static["positions"][:4].tolist() == [5, 9, 2, 0]
    assert graphs.static["slots"][:4].tolist() == [13, 25, 34, -1]  # the pad row writes no KV
    assert graphs.static["seq_lens"][:4].tolist() == [6, 10, 3, 1]  # reads one key of block 0
    assert graphs.static["block_tables"][:4].tolist() == [*tables.tolist(), [0] * 5]
    meta = graphs.metadata(4)
    assert meta.num_decodes == meta.num_tokens == 4
    assert meta.decode_max_seq_len == 20 and meta.decode_num_splits >= 1
    # A later, smaller step re-pads rows that held a real request before.
    graphs._stage(1, 1, np.array([7]), np.array([6]), np.array([14]), np.array([7]), tables[:1])
    assert graphs.static["slots"][:1].tolist() == [14]


def test_fits_only_decode_only_steps_of_a_captured_size() -> None:
    graphs = _graphs()
    assert not graphs.fits(np.ones(2, dtype=np.int64))  # nothing captured yet
    graphs.graphs[2] = object()  # type: ignore[assignment]  (stands for a captured graph)
    assert graphs.fits(np.ones(2, dtype=np.int64))
    assert not graphs.fits(np.array([1, 3]))  # a prefill chunk: eager
    assert not graphs.fits(np.ones(7, dtype=np.int64))  # more rows than any graph
    with pytest.raises(ValueError, match="no captured graph"):
        graphs.run(*(np.zeros(3, dtype=np.int64),) * 4, np.zeros((3, 5), dtype=np.int64))


def test_rope_table_is_rebuilt_for_another_cos_tensor() -> None:
    from services.worker.attention.select import TritonAttentionMetadata

    meta = TritonAttentionMetadata(
        num_tokens=2,
        slot_mapping=torch.zeros(2),
        token_index=torch.arange(2),
        num_kv_heads=1,
        backend=TritonPagedAttention(),
    )
    cos, sin = torch.rand(2, 1, 8), torch.rand(2, 1, 8)
    table = meta.rope_table(cos, sin)
    assert torch.equal(table, torch.cat((cos[:, 0, :4], sin[:, 0, :4]), dim=-1))
    assert meta.rope_table(cos, sin) is table  # later layers of the step reuse it
    cos2 = torch.rand(2, 1, 8)  # e.g. the graph capture after its warm-up forward
    assert torch.equal(meta.rope_table(cos2, sin)[:, :4], cos2[:, 0, :4])
