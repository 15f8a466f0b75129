"""bench/gpu/run_bound.py: the computed bound of a batch run (#36), pure arithmetic (CPU)."""

from __future__ import annotations

import pytest

from bench.gpu.run_bound import ModelCosts, Rates, run_bound
from services.worker.models.random_init import random_hf_config
from shared.model.config import ModelConfig

H200 = Rates(read_tbs=4.16, gemm_tflops=683.0)  # the rates of bench/RESULTS.md's hand bound


def llama_8b() -> ModelCosts:
    return ModelCosts.of(ModelConfig.from_hf_dict(random_hf_config("random:llama-3-8b")))


def test_costs_are_llama_3_8b_sizes() -> None:
    costs = llama_8b()
    # 8.03 B parameters, of which 2 x 0.525 B are the embedding and the untied LM head
    assert costs.layer_params + 2 * costs.head_params == pytest.approx(8.03e9, rel=1e-3)
    assert costs.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB a token in bf16


def test_matches_the_hand_arithmetic_of_the_results() -> None:
    """RESULTS.md worked these out by hand (2026-12-05): ~6,400 tok/s at batch 64 and 8,740 at
    256 (2.70 s of prefill + 127 steps of ~8.25 ms), prompt 512, output 128."""
    costs = llama_8b()
    b64 = run_bound(costs, H200, 64, 512, 128)
    b256 = run_bound(costs, H200, 256, 512, 128)
    assert b64["bound_tok_s"] == pytest.approx(6400, rel=0.01)
    assert b256["bound_tok_s"] == pytest.approx(8740, rel=0.01)
    assert b256["prefill_s"] == pytest.approx(2.70, rel=0.01)
    assert b256["decode_s"] / 127 == pytest.approx(8.25e-3, rel=0.01)


def test_a_step_is_held_to_the_slower_of_bytes_and_flops() -> None:
    costs = llama_8b()
    slow_gemm = Rates(read_tbs=4.16, gemm_tflops=50.0)  # every batch-256 step compute-bound
    memory = run_bound(costs, H200, 256, 512, 128)
    compute = run_bound(costs, slow_gemm, 256, 512, 128)
    assert memory["decode_steps_memory_bound"] == 127
    assert compute["decode_steps_memory_bound"] == 0
    step_flops = 256 * 2 * (costs.layer_params + costs.head_params)
    assert compute["decode_s"] == pytest.approx(127 * step_flops / 50e12, rel=1e-3)


def test_longer_contexts_read_more_kv() -> None:
    costs = llama_8b()
    short = run_bound(costs, H200, 64, 512, 128)
    long = run_bound(costs, H200, 64, 4096, 128)
    assert long["decode_s"] > 1.5 * short["decode_s"]
    assert long["bound_tok_s"] < short["bound_tok_s"]


def test_refuses_models_it_does_not_model() -> None:
    moe = random_hf_config("random:llama-3-8b") | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
    }
    with pytest.raises(ValueError, match="dense"):
        ModelCosts.of(ModelConfig.from_hf_dict(moe))
