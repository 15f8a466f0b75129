"""A drafter's captured `observe` (services/worker/accel/observe_graphs.py: a feature head's
forward, the DFlash draft's context K/V) run without capture, on the Triton kernels (through
the interpreter on a machine without a GPU): after a verify step, every row padded to K + 1
pairs, it leaves the head's newest outputs and its KV of the verified pairs as the eager
`observe` does, and the next proposal drafts the same tokens. Steps it cannot hold (a
prefill's many pairs) stay eager. On CUDA the same body is captured and replayed
(tests/gpu/test_spec_cuda.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.accel.observe_graphs import ContextGraphs, HeadObserveGraphs, ObserveGraphs
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.draft_sampler import DraftSampler
from services.worker.spec.feature_drafter import FeatureDrafter
from tests.support.observed_drafter import PROMPTS, K, observed, write_checkpoints

#: per row, the drafts it verified and how many of them the target accepted: row 0 takes two
#: of three (three pairs to observe), row 1 none (one pair)
DRAFTS = ([61, 62, 63], [71, 72, 73])
ACCEPTED = (2, 0)
CORRECTIONS = (90, 91)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoints(tmp_path_factory.mktemp("observe_graphs"))


def uncaptured(graphs: ObserveGraphs) -> ObserveGraphs:
    """`graphs` whose replay runs the captured body eagerly from the static inputs."""

    def run(batch, hidden, aux, rows, starts, ends, flat_starts) -> None:  # type: ignore[no-untyped-def]
        size = graphs.load(batch, hidden, rows, starts, ends, flat_starts)
        graphs.gather(hidden, aux, size)
        graphs.replays[size] = graphs.replays.get(size, 0) + 1
        graphs.forward(size, graphs.metadata(size))

    graphs.graphs = dict.fromkeys(graphs.sizes)  # type: ignore[arg-type]
    graphs.captured_pool = graphs.kv.layers[0]
    graphs.run = run  # type: ignore[method-assign]
    return graphs


def verify_step(state) -> None:  # type: ignore[no-untyped-def]
    """Both rows verify K drafts (K + 1 queries each from the bonus input t[N - 1]); the
    target accepts ACCEPTED of them plus a correction; the drafter observes the step."""
    batch: InputBatch = state.batch
    lens = np.array([len(p) for p in PROMPTS])
    ids = [t for p, d in zip(PROMPTS, DRAFTS, strict=True) for t in [p[-1], *d]]
    query_lens = np.full(2, K + 1)
    seq_lens = lens - 1 + K + 1
    hidden, aux = state.forward(ids, query_lens, seq_lens)
    for row, (drafts, accepted, fix) in enumerate(zip(DRAFTS, ACCEPTED, CORRECTIONS, strict=True)):
        n = int(lens[row])
        new = [*drafts[:accepted], fix]
        batch.token_ids[row, n : n + len(new)] = new
        batch.num_tokens[row] = n + len(new)
        batch.num_computed_tokens[row] = n + accepted
    with torch.inference_mode():
        state.drafter.observe(batch, hidden, aux, np.array([0, 1]), query_lens, seq_lens)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "dflash"])
def test_the_static_observe_feeds_the_head_what_the_eager_observe_does(
    checkpoints: Path, method: str
) -> None:
    runs = []
    for static in (False, True):
        state = observed(checkpoints, method)
        inner = state.drafter.features
        assert inner is not None
        if static:
            kind = ContextGraphs if method == "dflash" else HeadObserveGraphs
            inner.observe_graphs = uncaptured(
                kind(inner, num_spec_tokens=K, max_num_reqs=4, max_model_len=64, sizes=(4,))
            )
        verify_step(state)
        if static:
            assert inner.observe_graphs.replays == {4: 1}  # type: ignore[union-attr]
        batch = state.batch
        rows = np.array([0, 1])
        assert all(inner.ready(batch, r) for r in rows.tolist())
        ends = inner.kv.written[rows].copy()
        # the head's KV of every verified pair, read through each row's table
        kv = [
            torch.stack([layer[:, inner.kv.tables[r, p // 16], p % 16] for p in range(int(e))])
            for layer in inner.kv.layers
            for r, e in zip(rows.tolist(), ends.tolist(), strict=True)
        ]
        draws = DraftSampler(
            state.sampler, batch, rows, np.full(2, K), state.drafter.vocab_size, inner.vocab_map
        )
        newest = inner.last[:2].clone() if isinstance(inner, FeatureDrafter) else None
        with torch.inference_mode():
            inner.propose(batch, draws)
        runs.append((ends, newest, kv, draws.drafts()))
    (ends, newest, kv, drafts), (s_ends, s_newest, s_kv, s_drafts) = runs
    lens = np.array([len(p) for p in PROMPTS])
    assert ends.tolist() == s_ends.tolist() == (lens + np.array(ACCEPTED)).tolist()
    if newest is not None:
        torch.testing.assert_close(s_newest, newest, rtol=1e-4, atol=1e-4)
    for eager_kv, static_kv in zip(kv, s_kv, strict=True):
        torch.testing.assert_close(static_kv, eager_kv, rtol=1e-4, atol=1e-4)
    assert s_drafts[0] == drafts[0] and len(drafts[0]) == K  # the greedy row
    assert [len(d) for d in s_drafts] == [K, K]


def test_a_prefill_is_observed_eagerly(checkpoints: Path) -> None:
    """A prompt's pairs (more than K + 1 a row) do not fit the graphs: `takes` refuses them,
    and a step of the rows' next tokens does fit."""
    state = observed(checkpoints, "eagle")
    inner = state.drafter.features
    assert isinstance(inner, FeatureDrafter)
    graphs = HeadObserveGraphs(
        inner, num_spec_tokens=K, max_num_reqs=4, max_model_len=64, sizes=(4,)
    )
    graphs.graphs = dict.fromkeys(graphs.sizes)  # type: ignore[arg-type]
    batch, rows = state.batch, np.array([0, 1])
    lens = np.array([len(p) for p in PROMPTS])
    assert not graphs.takes(batch, rows, np.zeros(2, dtype=np.int64), lens - 1)
    assert graphs.takes(batch, rows, lens - 2, lens - 1)
    inner.kv.written[0] = 0  # a row whose head KV a prefix hit left unfilled
    assert not graphs.takes(batch, rows, lens - 2, lens - 1)
