"""Random-weight models at real shapes (benchmarks) and the worker's `random:` model spec."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.models.random_init import (
    PRESETS,
    build_random_model,
    is_random_spec,
    random_hf_config,
    random_source,
)
from services.worker.models.registry import build_model
from services.worker.runner.bootstrap import build_runner
from services.worker.runner.model_runner import ModelRunner
from shared.config import WorkerSettings
from shared.model.config import ModelConfig
from shared.model.source import resolve_model
from shared.protocol import NewRequestData, SamplingParams, StepPlan
from tests.support.tiny_llama import RANDOM_TINY_LLAMA

TINY = {**RANDOM_TINY_LLAMA, "attention_bias": True, "eos_token_id": 5}


def test_llama_3_8b_preset_has_the_real_shape() -> None:
    config = ModelConfig.from_hf_dict(random_hf_config("random:llama-3-8b"))
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        4096, 32, 14336,
    )  # fmt: skip
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (
        32, 8, 128256,
    )  # fmt: skip
    with torch.device("meta"):  # counts parameters without allocating 16 GB
        model = build_model(config, max_model_len=1024)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Meta-Llama-3-8B
    for name in PRESETS:
        ModelConfig.from_hf_dict(random_hf_config(f"random:{name}"))


def test_random_weights_are_filled_by_role() -> None:
    model, _ = build_random_model(TINY, torch.float32, "cpu", std=0.05, seed=7)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    assert torch.equal(params["norm.weight"], torch.ones(32))
    assert not params["layers.0.self_attn.qkv_proj.bias"].any()
    weight = params["layers.1.mlp.down_proj.weight"].float()
    assert abs(weight.std().item() - 0.05) < 0.01 and abs(weight.mean().item()) < 0.01
    again, _ = build_random_model(TINY, torch.float32, "cpu", std=0.05, seed=7)
    assert torch.equal(again.embed_tokens.weight, model.embed_tokens.weight)  # seeded


def test_random_spec_resolution(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert is_random_spec("random:llama-3-8b") and not is_random_spec("/models/llama")
    assert random_hf_config(f"random:{tmp_path}")["hidden_size"] == 32
    assert random_hf_config(f"random:{tmp_path}/config.json")["hidden_size"] == 32
    assert random_source("random:llama-3-8b").name == "random-llama-3-8b"
    with pytest.raises(ValueError, match="not a preset"):
        random_source("random:no-such-model")


def _one_prefill_step(runner: ModelRunner) -> None:
    """A 4-token prefill runs and samples a token in the vocabulary; the KV it wrote is finite."""
    plan = StepPlan(
        step_id=1, scheduler_id="s", worker_incarnation="inc-1",
        new_requests=[NewRequestData(
            request_id="r", token_ids=[1, 2, 3, 4], num_prompt_tokens=4, num_computed_tokens=0,
            block_ids=[[1, 2]], sampling=SamplingParams(temperature=0.0, max_tokens=4),
        )],
        num_scheduled_tokens={"r": 4},
    )  # fmt: skip
    result = runner.execute(plan)
    assert result.error is None and len(result.sampled) == 1
    assert 0 <= result.sampled[0].token_ids[0] < 64
    assert np.isfinite(runner.kv_cache.layers[0][0, 1].numpy()).all()


def test_worker_serves_a_random_spec(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    spec = f"random:{tmp_path / 'config.json'}"
    settings = WorkerSettings(
        model=spec, device="cpu", dtype="float32", max_model_len=32, kv_cache_bytes=2**20
    )
    runner, ready = build_runner(random_source(spec), settings, "inc-1")
    assert (ready.vocab_size, ready.max_model_len, ready.eos_token_ids) == (64, 32, [5])
    _one_prefill_step(runner)


def test_load_format_dummy_serves_a_checkpoint_directory_without_weights(tmp_path: Path) -> None:
    """MESHLLM_LOAD_FORMAT=dummy (vLLM's --load-format dummy): the directory the gateway reads
    its tokenizer from holds only config.json here; the worker builds random weights at its
    shapes instead of loading, and without the setting the same directory does not load."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    source = resolve_model(str(model_dir), tmp_path / "cache")
    fields = dict(device="cpu", dtype="float32", max_model_len=32, kv_cache_bytes=2**20)
    settings = WorkerSettings(model=str(model_dir), load_format="dummy", **fields)  # type: ignore[arg-type]
    runner, ready = build_runner(source, settings, "inc-1")
    assert (ready.model, ready.vocab_size, ready.eos_token_ids) == ("model", 64, [5])
    _one_prefill_step(runner)
    with pytest.raises(CheckpointError, match=r"holds no \.safetensors weights"):
        build_runner(source, WorkerSettings(model=str(model_dir), **fields), "inc-2")  # type: ignore[arg-type]
