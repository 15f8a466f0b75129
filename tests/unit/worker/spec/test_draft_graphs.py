"""The captured draft loop's body (services/worker/accel/draft_graphs.py) run without capture,
on the Triton kernels (through the interpreter on a machine without a GPU): from its static
inputs, padded past the real rows, it proposes exactly the eager loop's drafts and q (a greedy
row and a seeded sampled row; an EAGLE head on the target's vocabulary, an EAGLE-3 head with
its own smaller one, MTP, a draft model after its eager catch-up and first draw, the DFlash
draft's non-causal block forward) and writes the same KV, pads writing none. On CUDA the same
body is captured and replayed (tests/gpu/test_spec_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.accel.draft_graphs import (
    BlockGraphs,
    DraftGraphs,
    DraftModelGraphs,
    LoopGraphs,
)
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.draft_sampler import DraftSampler
from tests.support.observed_drafter import K, observed, write_checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoints(tmp_path_factory.mktemp("draft_graphs"))


def uncaptured(graphs: LoopGraphs) -> LoopGraphs:
    """`graphs` whose replay runs the loop's body eagerly from the static inputs (no CUDA
    graph on a CPU): what a replay computes, staged and handed over as `run` does."""

    def run(batch: InputBatch, draws: DraftSampler) -> None:
        size = graphs.load(batch, draws)
        graphs.replays[size] = graphs.replays.get(size, 0) + 1
        tokens = graphs.forward(size, graphs.metadata(size))
        draws.take(tokens[:, : len(draws.rows)], graphs.q[: len(draws.rows)])

    graphs.graphs = dict.fromkeys(graphs.sizes)  # type: ignore[arg-type]
    graphs.captured_pool = graphs.kv.layers[0]
    graphs.run = run  # type: ignore[method-assign]
    return graphs


#: method -> its loop's graphs
LOOPS = {
    "eagle": DraftGraphs,
    "eagle3": DraftGraphs,
    "mtp": DraftGraphs,
    "draft": DraftModelGraphs,
    "dflash": BlockGraphs,
}


@pytest.mark.parametrize("method", list(LOOPS))
@pytest.mark.parametrize("real", [2, 1])
def test_the_static_loop_proposes_what_the_eager_loop_does(
    checkpoints: Path, method: str, real: int
) -> None:
    """`real` rows in a graph of 4 rows (the rest pads): drafts, q and KV equal the eager
    loop's."""
    rows, ks = np.arange(2)[-real:], np.full(real, K)  # one row alone: the sampled one
    proposals, pools = [], []
    for static in (False, True):
        state = observed(checkpoints, method)
        drafter, batch, sampler = state.drafter, state.batch, state.sampler
        inner = drafter.features or drafter.draft_model
        options = dict(
            num_spec_tokens=K, target_vocab_size=drafter.vocab_size, max_num_reqs=4,
            max_model_len=64, sizes=(4,),
        )  # fmt: skip
        if static:
            inner.graphs = uncaptured(LOOPS[method](inner, **options))
        draws = DraftSampler(sampler, batch, rows, ks, drafter.vocab_size, inner.vocab_map)
        with torch.inference_mode():
            inner.propose(batch, draws)
        if static:
            assert inner.graphs.replays == {4: 1}
        proposals.append((draws.drafts(), draws.q))
        pools.append([layer.clone() for layer in inner.kv.layers])
    (eager, q_eager), (static_drafts, q_static) = proposals
    assert static_drafts == eager and all(len(d) == K for d in eager)
    assert q_eager is not None and q_static is not None
    torch.testing.assert_close(q_static[-1], q_eager[-1])  # the sampled row's q
    block0 = 0  # pads (N = 1, an all-zero table) aim at pool block 0, which row 0 holds
    for before, after in zip(*pools, strict=True):
        torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-2)
        assert torch.equal(after[:, block0, :K], before[:, block0, :K])
    if real == 2:
        assert len({tuple(d) for d in eager}) == 2
