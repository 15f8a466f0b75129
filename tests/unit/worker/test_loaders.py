"""Loaders: GGUF gives the same weights and config as the converted HF directory; sharded
safetensors load like a single file; broken checkpoints are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.loader import CheckpointError, load_model, resolve_dtype
from shared.model.config import ModelConfig, UnsupportedModelError
from shared.model.gguf_reader import hf_name, unpermute_rope_rows
from shared.model.source import ModelSource, embedded_gguf_path
from tests.support.tiny_llama import make_tiny_llama


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (its `permute`)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    permuted = llama_cpp_permute(weight, heads=3)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 3), weight)


def test_gguf_names_map_to_hf_names() -> None:
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    with pytest.raises(UnsupportedModelError, match="no mapping"):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_gguf_weights_and_config_equal_the_converted_hf_dir(smollm2_dir: Path) -> None:
    hf_model, hf_config = load_model(smollm2_dir, torch.float32)
    gguf_model, gguf_config = load_model(embedded_gguf_path(), torch.float32)
    assert gguf_config == hf_config.model_copy(update={"torch_dtype": "float32"})
    assert gguf_config.tie_word_embeddings and gguf_config.eos_token_ids == [2]
    hf_state, gguf_state = hf_model.state_dict(), gguf_model.state_dict()
    assert hf_state.keys() == gguf_state.keys()
    for name, tensor in hf_state.items():
        torch.testing.assert_close(gguf_state[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_model_source_and_dtype(smollm2_dir: Path) -> None:
    source = ModelSource("smol", smollm2_dir, smollm2_dir)
    model, config = load_model(source, "bfloat16", max_model_len=512)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.rotary.cos.shape == (512, config.head_dim)
    assert resolve_dtype("auto", config, torch.device("cpu")) == torch.float32
    fp16 = config.model_copy(update={"torch_dtype": "float16"})
    assert resolve_dtype("auto", fp16, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", config, torch.device("cpu"))


def test_sharded_safetensors_load_like_one_file(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "one")
    reference = make_tiny_llama(tmp_path / "sharded")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one, _ = load_model(tmp_path / "one", torch.float32)
    sharded, config = load_model(tmp_path / "sharded", torch.float32)
    for name, tensor in one.state_dict().items():
        torch.testing.assert_close(sharded.state_dict()[name], tensor, rtol=0, atol=0)
    # fused q/k/v rows are [q; k; v] of the checkpoint
    layer = reference.model.layers[1].self_attn
    expected = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
    torch.testing.assert_close(sharded.layers[1].self_attn.qkv_proj.weight, expected)
    assert config.num_key_value_heads == 2 and not config.tie_word_embeddings


def test_broken_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.3"):
        load_model(tmp_path, torch.float32)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(CheckpointError, match=r"no \.safetensors"):
        load_model(tmp_path, torch.float32)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope.bin", torch.float32)
    assert ModelConfig.from_hf_dir(tmp_path).num_hidden_layers == 4
