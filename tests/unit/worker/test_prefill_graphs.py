"""The prefill graphs' padded layout (services/worker/accel/prefill_graphs.py): the step's tokens
in their flat order, one pad sequence after them that writes nothing and reads only block 0,
empty spans after it, and the smallest captured size that holds the step. The padded forward
is checked against the eager step in tests/kernels/test_worker_triton_path.py, the captured
graphs on CUDA in tests/gpu/test_prefill_graphs_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.accel.prefill_graphs import PrefillGraphs, prefill_layout
from services.worker.models.random_init import build_random_model
from services.worker.runner.kv_cache import KVCache
from tests.support.tiny_llama import RANDOM_TINY_LLAMA


def _step() -> dict[str, np.ndarray]:
    # A decode (position 9), a chunk of 3 tokens extending 4 cached ones, a fresh prompt of 2.
    return {
        "query_lens": np.array([1, 3, 2]),
        "seq_lens": np.array([10, 7, 2]),
        "input_ids": np.array([11, 21, 22, 23, 31, 32]),
        "positions": np.array([9, 4, 5, 6, 0, 1]),
        "slot_mapping": np.array([109, 204, 205, 206, 300, 301]),
    }


def test_tokens_keep_their_order_and_one_pad_sequence_follows() -> None:
    layout = prefill_layout(**_step(), size=8, num_seqs=5, capacity=64)
    assert layout is not None and (layout.size, layout.num_tokens) == (8, 6)
    assert layout.input_ids.tolist() == [11, 21, 22, 23, 31, 32, 0, 0]
    assert layout.positions.tolist() == [9, 4, 5, 6, 0, 1, 0, 0]
    assert layout.slots.tolist() == [109, 204, 205, 206, 300, 301, -1, -1]  # pads write nothing
    # Spans: the three requests, the pad (rows 6..7), then an empty span.
    assert layout.cu_seqlens_q.tolist() == [0, 1, 4, 6, 8, 8]
    assert layout.seq_lens.tolist() == [10, 7, 2, 2, 0]  # the pad: its own 2 keys


def test_a_step_that_fills_the_size_has_an_empty_pad() -> None:
    layout = prefill_layout(**_step(), size=6, num_seqs=4, capacity=64)
    assert layout is not None
    assert layout.cu_seqlens_q.tolist() == [0, 1, 4, 6, 6]
    assert layout.seq_lens.tolist() == [10, 7, 2, 0]


def test_steps_that_do_not_fit_run_eagerly() -> None:
    step = _step()
    assert prefill_layout(**step, size=4, num_seqs=5, capacity=64) is None  # 6 tokens > 4
    assert prefill_layout(**step, size=8, num_seqs=3, capacity=64) is None  # no seq for the pad
    assert prefill_layout(**step, size=8, num_seqs=5, capacity=9) is None  # 10 keys > 9
    assert prefill_layout(**step, size=64, num_seqs=5, capacity=40) is None  # pad: 58 keys
    assert prefill_layout(**step, size=8, num_seqs=4, capacity=10) is not None


def test_the_runner_layout_picks_the_smallest_captured_size() -> None:
    model, config = build_random_model(RANDOM_TINY_LLAMA, torch.float32, "cpu")
    kv = KVCache.allocate(config, 16, 4, torch.float32, "cpu")
    graphs = PrefillGraphs(
        model, kv.layers, TritonPagedAttention(), max_tokens=100, max_num_reqs=4,
        max_blocks_per_req=16, block_size=4, device="cpu",
    )  # fmt: skip
    assert graphs.sizes == (16, 32, 64) and graphs.num_seqs == 5  # capped at 64 keys a table
    assert graphs.layout(**_step()) is None  # nothing captured: eager
    graphs.graphs = dict.fromkeys(graphs.sizes)  # type: ignore[arg-type]  (captured on CUDA)
    layout = graphs.layout(**_step())
    assert layout is not None and layout.size == 16
    assert graphs.metadata(16).prefill_max_seqlen_q == 16  # the grid holds any split
    with pytest.raises(ValueError, match="max_tokens"):
        PrefillGraphs(
            model, kv.layers, TritonPagedAttention(), max_tokens=0, max_num_reqs=4,
            max_blocks_per_req=16, block_size=4, device="cpu",
        )  # fmt: skip
