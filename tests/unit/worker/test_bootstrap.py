"""Worker start-up: the KV cache must hold one sequence of the advertised context; a bf16 CPU
worker compiles its forward where it can and otherwise serves eagerly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.worker.models.packed_linear import PackedLinear, packing_supported
from services.worker.models.random_init import random_source
from services.worker.runner.bootstrap import build_runner, check_parallel_settings
from services.worker.runner.kv_cache import KVCacheSizeError
from services.worker.runner.model_runner import ModelRunner
from shared.config import WorkerSettings
from shared.model.source import ModelSource
from tests.support.tiny_llama import RANDOM_TINY_LLAMA


def test_kv_cache_smaller_than_one_context_is_refused(smollm2_dir):
    source = ModelSource("smollm2", smollm2_dir, smollm2_dir)
    # SmolLM2 fp32 KV: 30 layers x 2 x 3 heads x 64 x 4 bytes = 46 KiB per token.
    settings = WorkerSettings(kv_cache_bytes=64 * 2**20, max_model_len=8192, dtype="float32")
    with pytest.raises(KVCacheSizeError, match="MESHLLM_MAX_MODEL_LEN"):
        build_runner(source, settings, "inc")


def test_kv_cache_holding_the_context_starts(smollm2_dir):
    source = ModelSource("smollm2", smollm2_dir, smollm2_dir)
    settings = WorkerSettings(kv_cache_bytes=64 * 2**20, max_model_len=1024, dtype="float32")
    runner, ready = build_runner(source, settings, "inc")
    assert ready.max_model_len == 1024
    assert (ready.num_kv_blocks - 1) * ready.block_size >= 1024
    assert runner.batch.num_reqs == 0


def compile_settings(tmp_path: Path, **overrides: object) -> tuple[ModelSource, WorkerSettings]:
    (tmp_path / "config.json").write_text(json.dumps(RANDOM_TINY_LLAMA))
    spec = f"random:{tmp_path / 'config.json'}"
    fields: dict[str, object] = {
        "model": spec, "device": "cpu", "dtype": "bfloat16", "max_model_len": 32,
        "kv_cache_bytes": 2**20, **overrides,
    }  # fmt: skip
    return random_source(spec), WorkerSettings(**fields)  # type: ignore[arg-type]


def packed(runner: ModelRunner) -> bool:
    return any(isinstance(m, PackedLinear) for m in runner.model.modules())


def test_bf16_cpu_worker_compiles_its_forward(tmp_path: Path) -> None:
    runner, _ = build_runner(*compile_settings(tmp_path), "inc")
    assert runner.compiled is not None and not packed(runner)  # freezing packs the weights


@pytest.mark.parametrize(
    ("overrides", "env"),
    [
        ({"cpu_compile": "off"}, {}),
        ({"dtype": "float32"}, {}),
        ({"cpu_compile": "on"}, {"CXX": "/nonexistent/g++"}),
    ],
    ids=["off", "float32", "no-compiler"],
)
def test_worker_stays_eager_where_it_cannot_compile(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    overrides: dict[str, object],
    env: dict[str, str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    runner, _ = build_runner(*compile_settings(tmp_path, **overrides), "inc")
    assert runner.compiled is None
    # the eager layout is in place: bf16 linears packed where this CPU has oneDNN's bf16
    # kernels (AMD EPYC without AVX-512 has none), plain otherwise and in fp32
    dtype = runner.kv_cache.layers[0].dtype
    assert packed(runner) == (dtype == torch.bfloat16 and packing_supported(dtype, runner.device))


def test_tensor_parallel_groups_take_kv_offload_and_every_drafter_but_not_random_weights() -> None:
    check_parallel_settings(WorkerSettings(tp=2, kv_offload=True))  # the data path shards KV
    check_parallel_settings(WorkerSettings(tp=2, spec_method="ngram"))  # no draft weights
    for method in ("draft", "eagle", "eagle3"):  # replicated drafters (test_tp_drafters.py)
        check_parallel_settings(WorkerSettings(tp=2, spec_method=method, spec_model="x"))
    check_parallel_settings(WorkerSettings(tp=2, spec_method="mtp"))
    with pytest.raises(ValueError, match="MESHLLM_TP=1"):
        check_parallel_settings(WorkerSettings(tp=2, model="random:llama-3-8b"))
    with pytest.raises(ValueError, match="MESHLLM_TP=1"):
        check_parallel_settings(WorkerSettings(tp=2, load_format="dummy"))


def test_hybrid_worker_starts_eager_announces_its_state_group_and_takes_the_tier(
    tmp_path: Path, redis_url: str
) -> None:
    """A Bamba checkpoint: bf16 on CPU would compile, but the state layers run eagerly; the
    scheduler hears both groups; the KV offload connector (tier on) moves the attention group's
    K/V and, for P/D only (the scheduler asks), the state group's per-block states."""
    from services.worker.kv_offload.wiring import build_connector
    from tests.support.tiny_models import make_tiny

    make_tiny(tmp_path, "bamba")
    settings = WorkerSettings(
        model=str(tmp_path), device="cpu", dtype="bfloat16", max_model_len=64,
        kv_cache_bytes=2**21, block_size=4, kv_offload=True, redis_url=redis_url,
    )  # fmt: skip
    runner, ready = build_runner(ModelSource("bamba", tmp_path, tmp_path), settings, "inc")
    assert runner.compiled is None and runner.graphs is None
    assert [g.kind for g in ready.kv_groups] == ["full", "state"]
    connector = build_connector(settings, runner.kv_cache, runner.config, "bamba", "inc")
    try:
        assert [len(g) for g in connector.group_layers] == [1, 0]  # one attention layer
        assert not connector.blocks.is_state(0) and connector.blocks.is_state(1)
        assert [len(s) for s in connector.blocks.state_layers.values()] == [3]  # 3 Mamba layers
    finally:
        connector.close()
