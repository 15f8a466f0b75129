"""RoPE: every scaling variant's frequencies equal transformers' ROPE_INIT_FUNCTIONS, and the
rotation equals transformers' apply_rotary_pos_emb."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from services.worker.models.rope import RotaryEmbedding, apply_rotary, compute_inv_freq
from shared.model.config import ModelConfig

VARIANTS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
    },
}


def hf_config(rope: dict[str, Any] | None) -> LlamaConfig:
    params = {"rope_theta": 50000.0, "rope_type": "default", **(rope or {})}
    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=params,
    )


def ours(hf: LlamaConfig) -> ModelConfig:
    return ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inv_freq_matches_transformers(name: str) -> None:
    hf = hf_config(VARIANTS[name])
    expected, expected_factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    config = ours(hf)
    inv_freq, factor = compute_inv_freq(config.rope, 32, config.max_position_embeddings)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
    assert factor == pytest.approx(expected_factor)
    assert name != "linear" or not torch.equal(
        inv_freq, compute_inv_freq(ours(hf_config(None)).rope, 32, 256)[0]
    )


def test_dynamic_ntk_beyond_trained_length_matches_transformers() -> None:
    hf = hf_config(VARIANTS["dynamic"])
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=1000)
    inv_freq, _ = compute_inv_freq(ours(hf).rope, 32, 256, seq_len=1000)
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
    default, _ = compute_inv_freq(ours(hf_config(None)).rope, 32, 256)
    assert not torch.allclose(inv_freq, default)  # it really rescales past the trained length


@pytest.mark.parametrize("name", ["default", "llama3", "yarn"])
def test_cos_sin_tables_and_rotation_match_transformers(name: str) -> None:
    hf = hf_config(VARIANTS.get(name))
    reference = LlamaRotaryEmbedding(hf)
    positions = torch.tensor([[0, 1, 5, 63, 64, 200, 255]])
    x = torch.randn(1, 7, 32)
    cos_ref, sin_ref = reference(x, positions)
    rope = RotaryEmbedding(32, ours(hf).rope, max_position=256, max_position_embeddings=256)
    cos, sin = rope.lookup(positions[0])
    torch.testing.assert_close(cos[:, 0], cos_ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], sin_ref[0], rtol=0, atol=1e-6)

    q = torch.randn(1, 4, 7, 32)  # transformers layout [batch, heads, tokens, d]
    k = torch.randn(1, 2, 7, 32)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
    q_ours = apply_rotary(q[0].transpose(0, 1), cos, sin)  # ours: [tokens, heads, d]
    k_ours = apply_rotary(k[0].transpose(0, 1), cos, sin)
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_partial_rotary_leaves_the_tail_unrotated() -> None:
    config = ours(hf_config({"partial_rotary_factor": 0.5}))
    rope = RotaryEmbedding(32, config.rope, max_position=16, max_position_embeddings=256)
    cos, sin = rope.lookup(torch.tensor([3, 9]))
    assert cos.shape[-1] == 16
    x = torch.randn(2, 4, 32)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[..., 16:], x[..., 16:])
    assert not torch.allclose(out[..., :16], x[..., :16])
    # the rotated part is a rotation: norms of each (i, i + 8) pair are preserved
    torch.testing.assert_close(out[..., :16].norm(dim=-1), x[..., :16].norm(dim=-1))
