"""A hybrid (attention + Mamba2) model's steps with its state layers on the Triton kernels
(meshllm_kernels/mamba, run here through Triton's interpreter) against the same steps on the torch
reference ops: the logits and every layer's cache (K/V and the per-block conv / SSM states)
must agree after mixed steps — decode rows (one of them a request's first token), prefill
spans crossing block boundaries, spans continuing mid-block (the head / tail launches of
state_metadata.py), and a prefix-cache hit reading another request's full block.
tests/gpu/test_hybrid_cuda.py runs the path compiled, through the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import meshllm_kernels.mamba.decode_step as decode_step
import meshllm_kernels.mamba.prefill as prefill
from services.scheduler.config import kv_cache_groups_from
from services.worker.attention.groups import group_attention
from services.worker.attention.state_metadata import PrefillSpan, StateMetadata, prefill_launches
from services.worker.loader import load_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.state_cache import MambaState
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import reference_greedy
from tests.support.tiny_models import make_tiny

BS = 4
NUM_BLOCKS = 40
#: The model-level cases build their caches on the CPU and need Triton's interpreter; on a GPU
#: machine tests/gpu/test_hybrid_cuda.py runs the same path compiled.
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter"
)


def test_a_span_continuing_mid_block_runs_as_head_and_tail() -> None:
    """Host-side layout: a span starting mid-block writes its first boundary state to the
    block it reads, which one launch of the kernel may not do for a non-final write."""
    # rows 0-1 decodes; span A: 7 tokens from n = 6 (lead 2; boundaries 8, 12; end 13);
    # span B: 5 fresh tokens (boundary 4); span C: 6 tokens from n = 3 (boundaries 4, 8; 9).
    spans = [
        PrefillSpan(2, 9, 21, [(2, 21), (6, 22), (7, 23)], lead=2),
        PrefillSpan(9, 14, -1, [(4, 30), (5, 31)], lead=0),
        PrefillSpan(14, 20, 5, [(1, 5), (5, 6), (6, 7)], lead=3),
    ]
    first, second = prefill_launches(spans, torch.device("cpu"))
    assert (first.lo, first.hi) == (2, 20)
    assert first.cu_seqlens.tolist() == [0, 2, 7, 12, 13, 18]
    assert first.read_slot.tolist() == [21, -1, -1, 5, -1]
    assert first.write_slot.tolist() == [21, -1, 31, 5, -1]
    assert first.state_cu.tolist() == [0, 0, 0, 1, 1, 1]
    assert first.state_slots.tolist() == [30] and first.state_offsets.tolist() == [4]
    assert first.take is None
    assert (second.lo, second.hi) == (4, 20)
    assert second.cu_seqlens.tolist() == [0, 5, 11, 16]  # tail A, rows of B (not taken), tail C
    assert second.read_slot.tolist() == [21, -1, 5]
    assert second.write_slot.tolist() == [23, -1, 7]
    assert second.state_cu.tolist() == [0, 1, 1, 2]
    assert second.state_offsets.tolist() == [4, 4] and second.state_slots.tolist() == [22, 6]
    assert second.take is not None
    assert second.take.tolist() == [0, 1, 2, 3, 4, *range(11, 16)]
    # without a mid-block span there is one launch, and no plan at all on the reference path
    assert len(prefill_launches(spans[1:2], torch.device("cpu"))) == 1
    meta = StateMetadata.build(
        np.array([[3, 4, 0]]), np.array([5]), np.array([5]), BS, torch.device("cpu")
    )
    assert not meta.triton and meta.launches is None


@pytest.fixture(scope="module", params=["bamba", "granitemoehybrid"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(checkpoint dir, transformers model, (our model, config))."""
    path: Path = tmp_path_factory.mktemp(request.param)
    reference = make_tiny(path, request.param)
    return path, reference, load_model(path, torch.float32, "cpu")


class Calls:
    """Counts of the Mamba kernels' entry points (the mixer imports them at each call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decode = self.prefill = 0
        step, launch = decode_step.mamba_decode_step, prefill.mamba_prefill

        def counted_step(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.decode += 1
            return step(*args, **kwargs)

        def counted_prefill(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.prefill += 1
            return launch(*args, **kwargs)

        monkeypatch.setattr(decode_step, "mamba_decode_step", counted_step)
        monkeypatch.setattr(prefill, "mamba_prefill", counted_prefill)


def _step(model, config, cache, tables, query_lens, seq_lens, tokens, triton):  # type: ignore[no-untyped-def]
    """One flat-batch forward (requests in `tables`' row order, one-token ones first) ->
    logits; every group uses the same block table."""
    query_lens, seq_lens = np.array(query_lens), np.array(seq_lens)
    starts = seq_lens - query_lens
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, seq_lens, strict=True)])
    grouped = np.repeat(np.array(tables)[None], len(config.kv_groups), axis=0)
    rows = np.arange(len(query_lens))
    meta = group_attention(
        config.kv_groups, grouped, rows, query_lens, seq_lens, positions, BS,
        torch.device("cpu"), state_triton=triton,
    )  # fmt: skip
    with torch.inference_mode():
        ids, pos = torch.tensor(tokens), torch.from_numpy(positions)
        return model.compute_logits(model(ids, pos, meta, cache.layers))


def _assert_caches_equal(tri: KVCache, ref: KVCache) -> None:
    for i, (a, b) in enumerate(zip(tri.layers, ref.layers, strict=True)):
        if isinstance(b, MambaState):
            assert isinstance(a, MambaState)
            torch.testing.assert_close(a.conv, b.conv, rtol=1e-5, atol=1e-5, msg=f"conv {i}")
            torch.testing.assert_close(a.ssm, b.ssm, rtol=1e-4, atol=1e-4, msg=f"ssm {i}")
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"kv {i}")


@interpreter_only
def test_triton_state_layers_match_the_reference_on_mixed_steps(
    hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, (model, config) = hybrid
    mamba_layers = len(config.mamba_layers)
    assert mamba_layers and len(config.kv_groups) == 2
    ref, tri = (KVCache.allocate(config, NUM_BLOCKS, BS, torch.float32, "cpu") for _ in range(2))
    # the same random states in both pools: a state read from a block not written first (a
    # request's first token must read a zero state) shows
    torch.manual_seed(7)
    for a, b in zip(tri.layers, ref.layers, strict=True):
        if isinstance(b, MambaState):
            for pool in ("conv", "ssm"):
                getattr(b, pool).copy_(torch.randn_like(getattr(b, pool)))
                getattr(a, pool).copy_(getattr(b, pool))
    calls = Calls(monkeypatch)
    gen = np.random.default_rng(0)
    # block tables: r4 shares r0's first two blocks (a prefix hit of 8 tokens)
    table = {
        "r0": [1, 2, 3, 20], "r1": [4, 5, 19, 0], "r2": [6, 7, 0, 0], "r3": [8, 9, 10, 11],
        "r4": [1, 2, 12, 13], "r5": [14, 15, 16, 0], "r6": [17, 18, 0, 0],
    }  # fmt: skip

    def both(order: list[str], q_lens: list[int], seq_lens: list[int], launches: int) -> None:
        tokens = gen.integers(3, 500, sum(q_lens)).tolist()
        tables = [table[r] for r in order]
        before = (calls.decode, calls.prefill)
        a = _step(model, config, ref, tables, q_lens, seq_lens, tokens, False)
        assert (calls.decode, calls.prefill) == before  # the reference path: no kernel
        b = _step(model, config, tri, tables, q_lens, seq_lens, tokens, True)
        decodes = int(q_lens[0] == 1)
        assert calls.decode - before[0] == decodes * mamba_layers
        assert calls.prefill - before[1] == launches * mamba_layers
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        _assert_caches_equal(tri, ref)

    # Step 1: a one-token prompt (a decode row with no state: read -1), fresh 9 and 5.
    both(["r2", "r0", "r1"], [1, 9, 5], [1, 9, 5], launches=1)
    # Step 2: decodes (mid-block and at a boundary: r1 5 -> 6, r0 9 -> 10, r2 1 -> 2), a
    # fresh chunk of 6 (r3), a prefix hit (r4: 5 tokens after r0's first 8, reading r0's
    # full block 2), a fresh 3 (r5).
    both(["r2", "r0", "r1", "r3", "r4", "r5"], [1, 1, 1, 6, 5, 3], [2, 10, 6, 6, 13, 3], 1)
    # Step 3: decodes, r3 continues mid-block 6 -> 13 (head + tail: boundaries 8, 12), fresh
    # r6 of 5 between, r5 continues 3 -> 9 (head + tail): two launches.
    both(["r0", "r1", "r4", "r3", "r6", "r5"], [1, 1, 1, 7, 5, 6], [11, 7, 14, 13, 5, 9], 2)
    # Step 4: decodes (r3 at 13 -> 14, r5 at 9 -> 10, r0 at 11 -> 12: a boundary) and r1's
    # 2 tokens 7 -> 9: its end state's conv window reaches back into the block it read, which
    # its boundary state (after 8) overwrites: wrong in one launch, right as head + tail.
    both(["r0", "r3", "r5", "r1"], [1, 1, 1, 2], [12, 14, 10, 9], launches=2)
    # Step 5: decodes only.
    both(["r0", "r1", "r3"], [1, 1, 1], [13, 10, 15], launches=0)
    # the shared prefix block was read, never written: r0's state after 8 tokens still there
    assert calls.prefill > 0 and calls.decode > 0


@interpreter_only
def test_engine_on_the_triton_state_path_equals_transformers(
    hybrid: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real scheduler and runner (warmup, chunked prefill of 7 tokens a step beside
    decodes, then a prefix-cache hit) with every StateMetadata built for the Triton path:
    greedy tokens equal transformers' fp32 generate."""
    path, reference, (model, config) = hybrid
    build = StateMetadata.build.__func__  # type: ignore[attr-defined]

    def triton_build(cls: type, *args: Any, triton: bool | None = None, **kwargs: Any) -> Any:
        return build(cls, *args, triton=True, **kwargs)

    monkeypatch.setattr(StateMetadata, "build", classmethod(triton_build))
    calls = Calls(monkeypatch)
    engine = InProcessEngine(
        path, block_size=BS, model_and_config=(model, config), max_num_batched_tokens=7,
        scheduler_options={"kv_cache_groups": kv_cache_groups_from(config.kv_groups, BS)},
    )  # fmt: skip
    engine.runner.warmup()
    greedy = SamplingParams(max_tokens=5, temperature=0)
    g = torch.Generator().manual_seed(1)
    prompts = {f"r{i}": torch.randint(3, 500, (n,), generator=g).tolist() for i, n in
               enumerate([13, 9, 1])}  # fmt: skip
    out = engine.generate(prompts, greedy)
    hit = {"r3": [*prompts["r0"][:12], 7, 8]}  # the first 12 tokens' blocks are cached
    out.update(engine.generate(hit, greedy))
    assert out["r3"].num_cached_tokens == 12
    for rid, prompt in {**prompts, **hit}.items():
        assert out[rid].token_ids == reference_greedy(reference, prompt, 5), rid
    assert calls.decode > 0 and calls.prefill > 0
