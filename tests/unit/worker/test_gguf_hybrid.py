"""`granitehybrid` GGUF files (Bamba, GraniteMoeHybrid as llama.cpp's converter writes them):
the metadata picks the family and its layers; names map per family. Loading every weight and
the runner's logits against transformers are in test_gguf_families.py (GGUF_FAMILIES holds the
hybrid families too)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFReader

from services.worker.loader import load_model
from shared.model.config import ModelConfig, UnsupportedModelError
from shared.model.gguf_hybrid import BAMBA, GRANITE, hybrid_hf_name
from tests.support.tiny_gguf import make_tiny_gguf

HYBRIDS = ["bamba", "granitemoehybrid", "granitemoehybrid_dense"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: make_tiny_gguf(tmp_path_factory.mktemp(f), f)[0] for f in HYBRIDS}


def _config(path: Path) -> ModelConfig:
    return load_model(path)[1]


def test_one_gguf_architecture_two_families(files: dict[str, Path]) -> None:
    """The converter writes both as `granitehybrid`; Granite's scale keys tell them apart."""
    for family, path in files.items():
        arch = GGUFReader(str(path)).fields["general.architecture"].contents()
        assert arch == "granitehybrid", family
    bamba = _config(files["bamba"])
    assert bamba.architecture == BAMBA and bamba.model_type == "bamba"
    assert bamba.layer_types == ["mamba", "full_attention", "mamba", "mamba"]
    # The converter wrote the whole head (16) as rope dims (no attn_rotary_emb in a transformers
    # config); Bamba rotates half of it, as transformers does.
    rope_dims = GGUFReader(str(files["bamba"])).fields["granitehybrid.rope.dimension_count"]
    assert rope_dims.contents() == 16
    assert bamba.use_rope and bamba.rope.partial_rotary_factor == 0.5
    assert bamba.embedding_multiplier == 1.0 and bamba.attention_multiplier is None
    moe = _config(files["granitemoehybrid"])
    assert moe.architecture == GRANITE and moe.model_type == "granitemoehybrid"
    assert moe.layer_types == ["mamba", "full_attention", "mamba", "mamba"]
    assert moe.num_experts == 4 and moe.num_experts_per_tok == 2
    assert moe.moe_intermediate_size == 48 and moe.shared_mlp_intermediate_size == 40
    assert (moe.embedding_multiplier, moe.residual_multiplier) == (2.0, 0.5)
    assert (moe.attention_multiplier, moe.logits_scaling) == (0.2, 2.0)  # float32 read back
    assert not moe.use_rope  # rope.scaling.finetuned = false: llama.cpp applies no RoPE
    dense = _config(files["granitemoehybrid_dense"])
    assert dense.layer_types == ["full_attention", "mamba", "mamba", "full_attention"]
    assert dense.num_experts == 0 and dense.shared_mlp_intermediate_size == 96
    for config in (bamba, moe, dense):
        assert config.mamba is not None
        assert (config.mamba.n_heads, config.mamba.head_dim, config.mamba.n_groups) == (8, 16, 2)
        assert (config.mamba.d_state, config.mamba.d_conv, config.mamba.conv_bias) == (16, 4, True)
        assert not config.mamba.proj_bias


def test_hybrid_names_per_family() -> None:
    assert hybrid_hf_name("blk.0.ssm_a", BAMBA) == ("model.layers.0.mamba.A_log", None)
    assert hybrid_hf_name("blk.2.ssm_dt.bias", GRANITE) == ("model.layers.2.mamba.dt_bias", None)
    assert hybrid_hf_name("blk.1.ffn_norm.weight", BAMBA) == (
        "model.layers.1.pre_ff_layernorm.weight",
        None,
    )
    assert hybrid_hf_name("blk.1.ffn_norm.weight", GRANITE) == (
        "model.layers.1.post_attention_layernorm.weight",
        None,
    )
    assert hybrid_hf_name("output_norm.weight", BAMBA) == ("model.final_layernorm.weight", None)
    assert hybrid_hf_name("output_norm.weight", GRANITE) == ("model.norm.weight", None)
    # Granite's fused input_linear: gate rows (part 0) then up rows (part 1)
    assert hybrid_hf_name("blk.0.ffn_up_exps.weight", GRANITE) == (
        "model.layers.0.block_sparse_moe.input_linear.weight",
        1,
    )
    assert hybrid_hf_name("blk.0.ffn_gate.weight", GRANITE) == (
        "model.layers.0.shared_mlp.input_linear.weight",
        0,
    )
    assert hybrid_hf_name("blk.0.ffn_gate.weight", BAMBA) == (
        "model.layers.0.feed_forward.gate_proj.weight",
        None,
    )
    with pytest.raises(UnsupportedModelError, match="no BambaForCausalLM mapping"):
        hybrid_hf_name("blk.0.ffn_gate_exps.weight", BAMBA)


def test_missing_half_of_a_fused_projection_is_an_error(tmp_path: Path) -> None:
    """A file with `ffn_gate_shexp` but no `ffn_up_shexp` cannot give Granite's input_linear."""
    path, _ = make_tiny_gguf(tmp_path / "src", "granitemoehybrid")
    reader = GGUFReader(str(path))
    out = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(str(out), "granitehybrid")
    for key, field in reader.fields.items():
        if key.startswith("granitehybrid.") or key.startswith("tokenizer."):
            _copy_field(writer, key, field)
    for tensor in reader.tensors:
        if tensor.name != "blk.2.ffn_up_shexp.weight":
            shape = tuple(int(d) for d in reversed(tensor.shape))
            writer.add_tensor(tensor.name, np.array(tensor.data).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="gate or up part"):
        load_model(out)


def _copy_field(writer: gguf.GGUFWriter, key: str, field: gguf.ReaderField) -> None:
    value_type = field.types[0]
    sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
