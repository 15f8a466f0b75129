"""The verify graphs' padded layout (services/worker/accel/verify_graphs.py): each request's
1 + d tokens at the head of its k + 1 rows, pads that write nothing and sit at a valid
position, sequence lengths counted with the pads, and the gather back to the step's order.
The padded forward itself is checked against the eager step in
tests/kernels/test_worker_triton_path.py, the captured graphs on CUDA in tests/gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.accel.verify_graphs import VerifyGraphs, verify_layout
from services.worker.models.random_init import build_random_model
from services.worker.runner.kv_cache import KVCache
from tests.support.tiny_llama import RANDOM_TINY_LLAMA


def _step() -> dict[str, np.ndarray]:
    # Two requests: 3 tokens at positions 7..9 (2 drafts), 1 token at position 4 (none).
    return {
        "query_lens": np.array([3, 1]),
        "seq_lens": np.array([10, 5]),
        "input_ids": np.array([31, 32, 33, 41]),
        "positions": np.array([7, 8, 9, 4]),
        "slot_mapping": np.array([107, 108, 109, 204]),
    }


def test_each_request_fills_the_head_of_its_rows_and_pads_write_nothing() -> None:
    layout = verify_layout(**_step(), width=4, size=4, capacity=64)
    assert layout is not None and layout.size == 4
    assert layout.input_ids.tolist() == [31, 32, 33, 0, 41, 0, 0, 0] + [0] * 8
    assert layout.positions.tolist() == [7, 8, 9, 9, 4, 4, 4, 4] + [0] * 8
    assert layout.slots.tolist() == [107, 108, 109, -1, 204, -1, -1, -1] + [-1] * 8
    # The kernel puts a span's queries at the end of its sequence: the pads count.
    assert layout.seq_lens.tolist() == [11, 8, 4, 4]
    assert layout.gather.tolist() == [0, 1, 2, 4]
    assert layout.input_ids[layout.gather].tolist() == [31, 32, 33, 41]


def test_steps_that_do_not_fit_run_eagerly() -> None:
    step = _step()
    assert verify_layout(**step, width=2, size=4, capacity=64) is None  # 3 tokens > width
    assert verify_layout(**step, width=4, size=1, capacity=64) is None  # 2 requests > size
    assert verify_layout(**step, width=4, size=4, capacity=10) is None  # 11 keys > capacity
    assert verify_layout(**step, width=4, size=4, capacity=11) is not None


def test_the_runner_layout_picks_the_smallest_captured_size() -> None:
    model, config = build_random_model(RANDOM_TINY_LLAMA, torch.float32, "cpu")
    kv = KVCache.allocate(config, 16, 4, torch.float32, "cpu")
    graphs = VerifyGraphs(
        model, kv.layers, TritonPagedAttention(), num_spec_tokens=3, max_num_reqs=6,
        max_blocks_per_req=16, block_size=4, device="cpu",
    )  # fmt: skip
    assert graphs.sizes == (1, 2, 4, 6) and graphs.width == 4
    assert graphs.layout(**_step()) is None  # nothing captured: eager
    # Captured largest first (one memory pool), as capture_graphs does on CUDA.
    graphs.graphs = dict.fromkeys((6, 4, 2, 1))  # type: ignore[arg-type]
    layout = graphs.layout(**_step())
    assert layout is not None and layout.size == 2
    one = {name: value[-1:] for name, value in _step().items()}  # the decode-only request
    one["query_lens"], one["seq_lens"] = np.array([1]), np.array([5])
    single = graphs.layout(**one)
    assert single is not None and single.size == 1
    with pytest.raises(ValueError, match="num_spec_tokens"):
        VerifyGraphs(
            model, kv.layers, TritonPagedAttention(), num_spec_tokens=0, max_num_reqs=6,
            max_blocks_per_req=16, block_size=4, device="cpu",
        )  # fmt: skip
