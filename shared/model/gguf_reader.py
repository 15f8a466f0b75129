"""Weights and config read straight from a GGUF file with the `gguf` package.

The file's metadata is translated into the HF `config.json` dict that transformers would write
for the same model (`hf_config_from_gguf`), and `ModelConfig.from_hf_dict` reads that, so both
checkpoint formats go through one set of family rules (q/k/v biases, q/k norms, sliding layers,
MoE layers). Tensors are renamed and restored to HF layout by `gguf_names`; quantized tensors are
dequantized to fp32 with `gguf.quants.dequantize` (then cast to the serving dtype).

Architectures (`general.architecture`, as llama.cpp's convert_hf_to_gguf.py writes them): llama
(Llama; Mistral when a sliding window is set; Mixtral when it has experts), qwen2, qwen3,
qwen2moe, qwen3moe, gemma3, granitehybrid (Bamba or GraniteMoeHybrid: attention + Mamba2
layers, read by `gguf_hybrid`). Facts llama.cpp does not store are taken as llama.cpp assumes them:
Qwen2-MoE does not renormalise its top-k routing weights, Qwen3-MoE and Mixtral do; Gemma3's
every 6th layer is full attention, its sliding layers use RoPE base 10000, and its attention
scale is head_dim**-0.5 (hidden/heads for the 62-layer 27B).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from shared.model.config import ModelConfig, UnsupportedModelError
from shared.model.gguf_hybrid import hybrid_hf_config, hybrid_hf_tensors
from shared.model.gguf_names import (
    expert_hf_names,
    hf_name,
    to_hf_layout,
    unpermute_rope_rows,
)

__all__ = [
    "config_from_gguf",
    "hf_config_from_gguf",
    "hf_name",
    "iter_gguf",
    "open_gguf",
    "unpermute_rope_rows",
]

#: general.architecture -> (HF architecture, HF model_type); llama is refined by its metadata
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    # Bamba or GraniteMoeHybrid, told apart by gguf_hybrid
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
}
#: whether the MoE renormalises its top-k weights when the file has no expert_weights_norm
_NORM_TOPK_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_GEMMA3_SWA_PATTERN = 6  # llama.cpp: every 6th layer is full attention
_GEMMA3_LOCAL_THETA = 10000.0


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config_from_gguf(reader: GGUFReader) -> dict[str, Any]:
    """The HF config.json dict of the file's model (transformers 5 spelling)."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    architecture, model_type = _ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens.data) if tokens else 0)
    tensor_names = {t.name for t in reader.tensors}
    eos = {
        _field(reader, "tokenizer.ggml.eos_token_id"),
        _field(reader, "tokenizer.ggml.eot_token_id"),
    }
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "intermediate_size": int(
            get("feed_forward_length", 0) or get("expert_feed_forward_length")
        ),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": _rope(reader, arch, head_dim),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(int(e) for e in eos if e is not None),
        "dtype": "float32",
    }
    if arch == "granitehybrid":
        rope = hf["rope_parameters"]
        hf.update(hybrid_hf_config(get, hidden, head_dim, layers, tensor_names, rope))
        return hf
    hf["num_key_value_heads"] = int(get("attention.head_count_kv", heads))
    window = get("attention.sliding_window")
    num_experts = int(get("expert_count", 0) or 0)
    if arch == "llama" and window:
        hf.update(architectures=["MistralForCausalLM"], model_type="mistral")
    if arch == "llama" and num_experts:
        hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
    if window:
        hf["sliding_window"] = int(window)
        if arch == "gemma3":
            hf["layer_types"] = _gemma3_layer_types(reader, layers)
    if num_experts:
        hf.update(_moe(reader, arch, num_experts, layers, tensor_names))
    if arch == "gemma3":
        hf["hidden_activation"] = "gelu_pytorch_tanh"
        hf["query_pre_attn_scalar"] = hidden / heads if layers == 62 else head_dim
        local_theta = float(get("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
        hf["rope_parameters"] = {
            "full_attention": hf["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        }
    return hf


def _rope(reader: GGUFReader, arch: str, head_dim: int) -> dict[str, Any]:
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "partial_rotary_factor": rope_dim / head_dim,
    }
    if scaling in ("linear", "yarn"):
        rope["rope_type"] = scaling
        rope["factor"] = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    elif scaling != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    return rope


def _gemma3_layer_types(reader: GGUFReader, layers: int) -> list[str]:
    """llama.cpp's rule, unless the file carries an explicit per-layer pattern (true = sliding)."""
    pattern = _field(reader, "gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        slides = [bool(p) for p in pattern]
    else:
        slides = [(i + 1) % _GEMMA3_SWA_PATTERN != 0 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _moe(
    reader: GGUFReader, arch: str, num_experts: int, layers: int, tensor_names: set[str]
) -> dict[str, Any]:
    """MoE keys; a layer without a router (`ffn_gate_inp`) is dense (Qwen-MoE mlp_only_layers)."""
    norm = _field(reader, f"{arch}.expert_weights_norm")
    moe: dict[str, Any] = {
        "num_experts" if arch != "llama" else "num_local_experts": num_experts,
        "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
        "norm_topk_prob": _NORM_TOPK_DEFAULT.get(arch, True) if norm is None else bool(norm),
        "mlp_only_layers": [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
        ],
    }
    expert_ff = _field(reader, f"{arch}.expert_feed_forward_length")
    if expert_ff:
        moe["moe_intermediate_size"] = int(expert_ff)
    shared_ff = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared_ff:
        moe["shared_expert_intermediate_size"] = int(shared_ff)
    return moe


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config_from_gguf(reader))


def iter_gguf(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor in HF layout) for every tensor of the file (experts one by one)."""
    arch = _field(reader, "general.architecture")
    if arch == "granitehybrid":
        arrays = ((t.name, _array(t)) for t in reader.tensors)
        for converted_name, converted in hybrid_hf_tensors(arrays, config):
            yield converted_name, _torch(converted)
        return
    for tensor in reader.tensors:
        array = _array(tensor)
        experts = expert_hf_names(tensor.name, config.num_experts, arch)
        if experts is not None:
            if array.shape[0] != len(experts):
                raise UnsupportedModelError(
                    f"GGUF tensor {tensor.name!r} stacks {array.shape[0]} experts, "
                    f"expected {len(experts)}"
                )
            for expert_name, expert in zip(experts, array, strict=True):
                yield expert_name, _torch(expert)
            continue
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        array = to_hf_layout(
            arch, name, array, config.num_attention_heads, config.num_key_value_heads
        )
        yield name, _torch(array)


def _array(tensor: ReaderTensor) -> np.ndarray:
    """The tensor dequantized to fp32, in numpy (HF) dimension order."""
    array = dequantize(tensor.data, tensor.tensor_type)
    return array.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _torch(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not array.flags.writeable:  # an F32 tensor is a view of the read-only file mapping
        array = array.copy()
    return torch.from_numpy(array)


def open_gguf(path: Path) -> tuple[GGUFReader, ModelConfig]:
    reader = GGUFReader(str(path))
    return reader, config_from_gguf(reader)
