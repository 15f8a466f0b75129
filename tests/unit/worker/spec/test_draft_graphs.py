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

from meshllm_kernels.attention.backends import AttentionRequirements, select_backend
from services.worker.accel.draft_graphs import (
    BlockGraphs,
    DraftGraphs,
    DraftModelGraphs,
    LoopGraphs,
)
from services.worker.attention.reference import AttentionMetadata
from services.worker.loader import load_model
from services.worker.models.base import split_aux_hidden
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.kv_cache import KVCache
from services.worker.sampling import SamplingState
from services.worker.spec import SpeculativeConfig
from services.worker.spec.draft_sampler import DraftSampler
from services.worker.spec.drafts import Drafter
from shared.protocol import SamplingParams
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
)
from tests.support.tiny_llama import make_tiny_llama

K = 3
#: the Triton kernels compiled on a GPU machine, through the interpreter elsewhere
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ([5, 17, 99, 3, 250, 41, 8], list(range(20, 39)))
PARAMS = (
    SamplingParams(temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.8, seed=5, max_tokens=8),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("draft_graphs")
    target = root / "target"
    make_tiny_llama(target, seed=0)
    write_eagle_head(target, root / "eagle", std=0.3)
    write_eagle3_head(target, root / "eagle3", std=0.3, draft_vocab_size=128)
    write_mtp_target(target, root / "mtp", std=0.3)
    make_tiny_llama(root / "draft", seed=1, num_hidden_layers=1)
    write_dflash_draft(target, root / "dflash", std=0.3, num_layers=2, target_layers=(0, 1))
    return root


def observed(root: Path, method: str):  # type: ignore[no-untyped-def]
    """(drafter, batch, sampler) after a target prefill of both prompts, the head's cache on
    the Triton kernels."""
    served = root / ("mtp" if method == "mtp" else "target")
    target, _ = load_model(served, torch.float32, DEVICE)
    spec = SpeculativeConfig(method=method, model=str(root / method), num_spec_tokens=K)
    vocab = target.config.vocab_size
    drafter = Drafter(
        spec, vocab_size=vocab, max_num_reqs=4, max_model_len=64, device=DEVICE, target=target
    )
    inner = drafter.features or drafter.draft_model
    needs = AttentionRequirements(non_causal=method == "dflash")
    inner.kv.backend = select_backend("triton", needs)
    lens = np.array([len(p) - 1 for p in PROMPTS])
    cache = KVCache.allocate(target.config, 8, 16, torch.float32, DEVICE)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    slots = np.concatenate([tables[i, p // 16] * 16 + p % 16 for i, n in enumerate(lens)
                            for p in [np.arange(n)]])  # fmt: skip
    attn = AttentionMetadata.build(
        query_lens=lens, seq_lens=lens, block_tables=tables, block_size=16, slot_mapping=slots,
        device=DEVICE,
    )  # fmt: skip
    ids = torch.tensor([t for p in PROMPTS for t in p[:-1]], device=DEVICE)
    positions = torch.tensor([i for n in lens for i in range(n)], device=DEVICE)
    with torch.inference_mode():
        out = target(ids, positions, attn, cache.layers)
    hidden, aux = split_aux_hidden(out, target.config.hidden_size)
    batch = InputBatch(4, 64, 16)
    sampler = SamplingState(4, vocab, DEVICE)
    for row, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        batch.row_req[row], batch.sampling[row] = f"r{row}", params
        batch.token_ids[row, : len(prompt)] = prompt
        batch.num_tokens[row], batch.num_computed_tokens[row] = len(prompt), len(prompt) - 1
        sampler.add_request(row, params, prompt, [])
    rows = np.array([0, 1])
    drafter.observe(batch, hidden, aux, rows, lens, lens)
    return drafter, batch, sampler


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
        drafter, batch, sampler = observed(checkpoints, method)
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
