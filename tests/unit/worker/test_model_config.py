"""ModelConfig: both transformers config spellings, eos merging, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.model.config import ModelConfig, UnsupportedModelError


def llama_dict(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "eos_token_id": 2,
    }
    base.update(overrides)
    return base


def test_transformers5_rope_parameters() -> None:
    config = ModelConfig.from_hf_dict(
        llama_dict(rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    )
    assert config.rope.theta == 100000.0
    assert config.rope.rope_type == "default"
    assert config.head_dim == 16  # hidden / heads when not explicit
    assert config.num_queries_per_kv == 2


def test_transformers4_rope_theta_and_scaling() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    config = ModelConfig.from_hf_dict(llama_dict(rope_theta=500000.0, rope_scaling=scaling))
    assert config.rope.theta == 500000.0
    assert config.rope.rope_type == "llama3"
    assert config.rope.factor == 8.0
    assert config.rope.original_max_position_embeddings == 128


def test_legacy_scaling_type_key() -> None:
    config = ModelConfig.from_hf_dict(llama_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    assert config.rope.rope_type == "linear"
    assert config.rope.factor == 2.0
    assert config.rope.theta == 10000.0


def test_explicit_head_dim_and_flags() -> None:
    config = ModelConfig.from_hf_dict(
        llama_dict(head_dim=32, tie_word_embeddings=True, attention_bias=True, dtype="bfloat16")
    )
    assert config.head_dim == 32
    assert config.q_size == 128 and config.kv_size == 64
    assert config.tie_word_embeddings and config.attention_bias and not config.mlp_bias
    assert config.torch_dtype == "bfloat16"


def test_eos_ids_from_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(llama_dict(eos_token_id=[2, 7])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_hf_dir(tmp_path).eos_token_ids == [2, 7, 9]


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture.*Gpt2"):
        ModelConfig.from_hf_dict(llama_dict(architectures=["Gpt2LMHeadModel"]))


def test_unsupported_rope_type_and_activation() -> None:
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelConfig.from_hf_dict(llama_dict(rope_scaling={"rope_type": "longrope"}))
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_hf_dict(llama_dict(hidden_act="gelu"))


def test_heads_not_divisible_by_kv_heads() -> None:
    with pytest.raises(UnsupportedModelError, match="multiple"):
        ModelConfig.from_hf_dict(llama_dict(num_attention_heads=4, num_key_value_heads=3))


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_hf_dir(tmp_path)


@pytest.mark.parametrize("saved", [None, 1.0])
def test_bamba_rotates_half_of_each_head_unless_its_config_says(
    tmp_path: Path, saved: float | None
) -> None:
    """transformers' BambaConfig defaults partial_rotary_factor to 0.5 (a config.json saved by
    transformers 4.x has no such key) and keeps a stated one: so do we."""
    from transformers import BambaConfig

    from tests.support.tiny_models import make_tiny

    make_tiny(tmp_path, "bamba")
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    hf.pop("partial_rotary_factor", None)
    if saved is not None:
        hf["rope_parameters"] = {**hf.get("rope_parameters", {}), "partial_rotary_factor": saved}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    expected = 0.5 if saved is None else saved
    theirs = BambaConfig.from_pretrained(tmp_path).rope_parameters
    assert theirs["partial_rotary_factor"] == expected
    assert ModelConfig.from_hf_dir(tmp_path).rope.partial_rotary_factor == expected
