"""llama.cpp's `GraniteHybridModel` converter (Bamba and GraniteMoeHybrid -> `granitehybrid`),
reproduced for tests: the metadata it writes and the tensors it yields, from the saved checkpoint.

It reads `config.json` as json (Mamba2Model does, not AutoConfig), so `hparams` here is that
file. What it does, and is done here in the same order:
- metadata: TextModel's keys (context, embedding, feed-forward = `intermediate_size`, heads, KV
  heads, rope base, rms eps, expert count/used when the config has the keys — 0 experts for a
  dense GraniteMoeHybrid), LlamaModel's vocab size and rope dimension (= head dim), Granite's
  multipliers as `attention.scale`/`embedding_scale`/`residual_scale`/`logit_scale` (when
  truthy), the shared MLP size, the `ssm.*` keys, `attention.head_count_kv` as a per-layer
  array (0 on mamba layers), `attn_rotary_emb` as the rope dimension when the config has it,
  and `rope.scaling.finetuned` = "uses RoPE" (Bamba, or no mamba layer), with the context
  overwritten by 2**20 when it is false;
- tensors: mamba layers through Mamba2Model (`dt_bias` renamed `dt_proj.bias`, conv1d weight
  squeezed to [channels, kernel], A and D reshaped to [heads, 1], A_log stored as
  A = -exp(A_log), the gated norm reshaped to [n_groups, inner / n_groups]); attention layers
  through LlamaModel (Q/K rows permuted, `undo_permute = True`); GraniteMoe's fused
  `input_linear` rows [gate; up] split in two (experts: `ffn_gate_exps`/`ffn_up_exps`; shared
  MLP: `*_shexp` with experts, plain `ffn_gate`/`ffn_up`/`ffn_down` without).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = gguf.MODEL_ARCH.GRANITE_HYBRID
_T = gguf.MODEL_TENSOR
_NO_ROPE_CONTEXT = 2**20


def attention_layers(hparams: dict[str, Any]) -> list[int]:
    """GraniteHybridModel.get_attn_layers: `layer_types` entries equal to "attention" (IBM's
    spelling; the converter does not know transformers 5's "full_attention"), else
    `attn_layer_indices` (Bamba)."""
    if layer_types := hparams.get("layer_types"):
        return [i for i, kind in enumerate(layer_types) if kind == "attention"]
    return list(hparams["attn_layer_indices"])


def write_metadata(writer: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    layers = hp["num_hidden_layers"]
    attn = attention_layers(hp)
    heads = hp["num_attention_heads"]
    writer.add_block_count(layers)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base(hp["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_local_experts") is not None:
        writer.add_expert_count(hp["num_local_experts"])
    if hp.get("num_experts_per_tok") is not None:
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_rope_dimension_count(hp["hidden_size"] // heads)  # GraniteModel pops head_dim
    for key, add in (
        ("attention_multiplier", writer.add_attention_scale),
        ("embedding_multiplier", writer.add_embedding_scale),
        ("residual_multiplier", writer.add_residual_scale),
        ("logits_scaling", writer.add_logit_scale),
    ):
        if hp.get(key):
            add(hp[key])
    if hp.get("shared_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(hp["shared_intermediate_size"])
    writer.add_ssm_conv_kernel(hp["mamba_d_conv"])
    writer.add_ssm_state_size(hp["mamba_d_state"])
    writer.add_ssm_group_count(hp["mamba_n_groups"])
    writer.add_ssm_inner_size(hp["mamba_expand"] * hp["hidden_size"])
    writer.add_ssm_time_step_rank(hp["mamba_n_heads"])
    if hp.get("attn_rotary_emb"):
        writer.add_rope_dimension_count(hp["attn_rotary_emb"])
    kv = hp["num_key_value_heads"]
    writer.add_head_count_kv([kv if i in attn else 0 for i in range(layers)])
    use_rope = "BambaForCausalLM" in hp["architectures"] or len(attn) == layers
    writer.add_rope_scaling_finetuned(use_rope)
    if not use_rope:
        writer.add_context_length(_NO_ROPE_CONTEXT)


def converted_tensors(hf_dir: Path, hp: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 array) for every tensor of the checkpoint, as the converter yields them."""
    layers = hp["num_hidden_layers"]
    names = gguf.get_tensor_name_map(ARCH, layers)
    attn = attention_layers(hp)
    out: list[tuple[str, np.ndarray]] = []
    for name, tensor in sorted(load_file(hf_dir / "model.safetensors").items()):
        if name.endswith(".dt_bias"):  # Mamba2Model.filter_tensors
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        array = tensor.to(torch.float32).numpy().copy()
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        split = _split_fused(name, array, hp, bid)
        if split is not None:
            out.extend(split)
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"gguf-py has no granitehybrid name for {name}")
        if bid is not None and bid not in attn:
            array = _mamba2_values(gguf_name, name, array, hp)
        elif bid is not None:
            array = _llama_values(name, array, hp)
        out.append((gguf_name, array))
    return out


def _split_fused(
    name: str, array: np.ndarray, hp: dict[str, Any], bid: int | None
) -> list[tuple[str, np.ndarray]] | None:
    """GraniteMoeModel.modify_tensors: `input_linear` rows [gate; up] become two tensors."""
    has_experts = bool(hp.get("num_local_experts"))
    if name.endswith("block_sparse_moe.input_linear.weight"):
        size, parts = hp["intermediate_size"], (_T.FFN_GATE_EXP, _T.FFN_UP_EXP)
    elif name.endswith("shared_mlp.input_linear.weight"):
        size = hp["shared_intermediate_size"]
        parts = (_T.FFN_GATE_SHEXP, _T.FFN_UP_SHEXP) if has_experts else (_T.FFN_GATE, _T.FFN_UP)
    elif name.endswith("shared_mlp.output_linear.weight") and not has_experts:
        return [(_tensor_name(_T.FFN_DOWN, bid), array)]
    else:
        return None
    gate, up = np.split(array, [size], axis=-2)
    return [(_tensor_name(parts[0], bid), gate), (_tensor_name(parts[1], bid), up)]


def _tensor_name(kind: gguf.MODEL_TENSOR, bid: int | None) -> str:
    return gguf.TENSOR_NAMES[kind].format(bid=bid) + ".weight"


def _mamba2_values(gguf_name: str, name: str, array: np.ndarray, hp: dict[str, Any]) -> np.ndarray:
    """Mamba2Model.modify_tensors' value changes."""
    module = gguf_name.split(".")[2]
    if module == "ssm_conv1d" and gguf_name.endswith(".weight"):
        array = array.squeeze()
    elif module in ("ssm_a", "ssm_d"):
        array = array.reshape(*array.shape, 1)
    elif module == "ssm_norm":
        groups = hp["mamba_n_groups"]
        array = array.reshape(groups, hp["mamba_expand"] * hp["hidden_size"] // groups)
    if name.endswith(".A_log"):
        array = -np.exp(array)
    return array


def _llama_values(name: str, array: np.ndarray, hp: dict[str, Any]) -> np.ndarray:
    """LlamaModel.modify_tensors: Q/K rows permuted for llama.cpp's rotation of adjacent pairs
    (its permute takes the KV head count for K)."""
    if name.endswith("q_proj.weight"):
        return llama_cpp_permute(array, hp["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return llama_cpp_permute(array, hp["num_key_value_heads"])
    return array


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute on Q/K rows."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
