"""Hybrid attention + Mamba2 models (tiny fp32 bamba and granitemoehybrid) on the CUDA worker
through the real scheduler and runner (InProcessEngine): greedy tokens equal transformers' fp32
generate, with the state layers on the compiled Triton Mamba2 kernels (meshllm_kernels/mamba: the
decode step and the varlen chunked prefill, counted here) — several requests per step, chunked
prefill ending mid-block (the head / tail prefill launches), a prefix-cache hit, and overlapped
steps.

The models compared with transformers have one B/C group (`mamba_n_groups=1`): the H200's
transformers (5.17) normalises Bamba's gated RMSNorm over the whole intermediate size, where
mamba_ssm's `RMSNormGated(group_size=d_ssm // ngroups)`, transformers 5.24 and we normalise each
group apart; with one group they agree. Released Bamba and
Granite 4.0 checkpoints have one group. Two groups (the Triton kernels' group-to-head mapping)
are compared with the CPU runner instead, which the CPU suite checks against transformers.

Decode-only steps replay CUDA graphs (accel/hybrid_graphs.py: the attention layers on the
paged Triton metadata, the state layers' decode step reading static slot buffers), counted
here as `calls["replays"]`; steps with prefill rows run eagerly (`calls["decode"]` counts
their eager decode-step calls). The MoE granitemoehybrid's experts run the fused-MoE kernel
inside the graphs (its expert alignment is sized on the device:
meshllm_kernels/layers/fused_moe.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import meshllm_kernels.mamba.decode_step as decode_step
import meshllm_kernels.mamba.prefill as prefill
from services.scheduler.config import kv_cache_groups_from
from services.worker.accel.hybrid_graphs import HybridDecodeGraphs
from services.worker.loader import load_model
from services.worker.runner.bootstrap import build_runner
from shared.config import WorkerSettings
from shared.model.source import ModelSource
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import reference_greedy
from tests.support.tiny_models import make_tiny

BS = 4
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.fixture(scope="module", params=["bamba", "granitemoehybrid", "granitemoehybrid_dense"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp(request.param)
    reference = make_tiny(path, request.param, mamba_n_groups=1)  # module docstring
    return path, reference, load_model(path, torch.float32, "cuda")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the Mamba kernels' entry points (the mixer imports them at each call)."""
    counts = {"decode": 0, "prefill": 0, "replays": 0}
    step, launch = decode_step.mamba_decode_step, prefill.mamba_prefill

    def counted_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        counts["decode"] += 1
        return step(*args, **kwargs)

    def counted_prefill(*args: Any, **kwargs: Any) -> torch.Tensor:
        counts["prefill"] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(decode_step, "mamba_decode_step", counted_step)
    monkeypatch.setattr(prefill, "mamba_prefill", counted_prefill)
    return counts


def _engine(family: Any, calls: dict[str, int], **options: Any) -> InProcessEngine:
    path, _, (model, config) = family
    assert [g.kind for g in config.kv_groups] == ["full", "state"]
    engine = InProcessEngine(
        path,
        block_size=BS,
        model_and_config=(model, config),
        scheduler_options={"kv_cache_groups": kv_cache_groups_from(config.kv_groups, BS)},
        device="cuda",
        **options,
    )
    engine.runner.warmup()
    engine.runner.capture_cuda_graphs()
    graphs = engine.runner.graphs
    assert isinstance(graphs, HybridDecodeGraphs)
    replay = graphs.run_hybrid

    def counted_replay(*args: Any) -> torch.Tensor:
        calls["replays"] += 1
        return replay(*args)

    graphs.run_hybrid = counted_replay  # type: ignore[method-assign]
    return engine


def _prompts(seed: int, lengths: list[int], shared: int = 0) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (shared,), generator=generator).tolist()
    return {
        f"r{i}": prefix + torch.randint(3, 500, (n,), generator=generator).tolist()
        for i, n in enumerate(lengths)
    }


def _check(family: Any, prompts: dict[str, list[int]], out: dict[str, Any]) -> None:
    for rid, prompt in prompts.items():
        assert out[rid].token_ids == reference_greedy(family[1], prompt, MAX_TOKENS), rid


def test_batched_requests_equal_transformers(family: Any, calls: dict[str, int]) -> None:
    engine = _engine(family, calls)
    calls.update(decode=0, prefill=0, replays=0)
    prompts = _prompts(0, [1, 5, 13, 24, 37])
    _check(family, prompts, engine.generate(prompts, GREEDY))
    assert calls["replays"] > 0 and calls["prefill"] > 0


def test_chunked_prefill_with_a_tiny_budget(family: Any, calls: dict[str, int]) -> None:
    """7 tokens a step: chunks continue mid-block across boundaries, beside decodes."""
    engine = _engine(family, calls, max_num_batched_tokens=7)
    calls.update(decode=0, prefill=0, replays=0)
    prompts = _prompts(1, [30, 19, 3])
    _check(family, prompts, engine.generate(prompts, GREEDY))
    assert engine.max_tokens_per_step == 7
    assert calls["decode"] > 0 and calls["prefill"] > 0


def test_prefix_hit_reads_the_cached_state(family: Any, calls: dict[str, int]) -> None:
    engine = _engine(family, calls)
    prompts = _prompts(2, [3, 9, 6], shared=26)
    for i, (rid, prompt) in enumerate(prompts.items()):
        out = engine.generate({rid: prompt}, GREEDY)
        _check(family, {rid: prompt}, out)
        if i:
            assert out[rid].num_cached_tokens == 24, rid
    assert engine.scheduler.kv.stats.hits > 0
    assert calls["prefill"] > 0


def test_overlapped_steps_equal_transformers(family: Any, calls: dict[str, int]) -> None:
    engine = _engine(family, calls, max_num_batched_tokens=9)
    prompts = _prompts(5, [3, 17, 26])
    _check(family, prompts, engine.generate(prompts, GREEDY, overlap=True))
    assert engine.launched_ahead > 0
    assert calls["replays"] > 0


@pytest.mark.parametrize("name", ["bamba", "granitemoehybrid"])
def test_two_groups_equal_the_cpu_runner(
    name: str, tmp_path_factory: pytest.TempPathFactory, calls: dict[str, int]
) -> None:
    """B and C in two groups, each shared by half the heads: the Triton kernels' mapping of
    head to group on CUDA gives the CPU runner's tokens (module docstring)."""
    path = tmp_path_factory.mktemp(f"{name}-groups")
    make_tiny(path, name)
    prompts = _prompts(7, [2, 11, 29], shared=0)
    outputs = {}
    for device in ("cuda", "cpu"):
        model_and_config = load_model(path, torch.float32, device)
        assert model_and_config[1].mamba is not None and model_and_config[1].mamba.n_groups == 2
        engine = InProcessEngine(
            path,
            block_size=BS,
            model_and_config=model_and_config,
            scheduler_options={
                "kv_cache_groups": kv_cache_groups_from(model_and_config[1].kv_groups, BS)
            },
            device=device,
            max_num_batched_tokens=9,
        )
        out = engine.generate(prompts, GREEDY)
        outputs[device] = {rid: out[rid].token_ids for rid in prompts}
    assert outputs["cuda"] == outputs["cpu"]
    assert calls["decode"] > 0 and calls["prefill"] > 0


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_serving_worker_captures_hybrid_graphs_unless_told(
    tmp_path: Path, enforce_eager: bool
) -> None:
    """build_runner (what the worker service runs) captures the hybrid decode graphs on CUDA;
    MESHLLM_ENFORCE_EAGER keeps every step eager."""
    make_tiny(tmp_path, "bamba")
    settings = WorkerSettings(
        model=str(tmp_path), device="cuda", dtype="float32", max_model_len=64,
        kv_cache_bytes=2**22, block_size=BS, kv_offload=False,
        enforce_eager=enforce_eager,
    )  # fmt: skip
    runner, _ = build_runner(ModelSource("bamba", tmp_path, tmp_path), settings, "inc")
    if enforce_eager:
        assert runner.graphs is None
    else:
        assert isinstance(runner.graphs, HybridDecodeGraphs)
        assert set(runner.graphs.graphs) == set(runner.graphs.sizes)  # every size captured
