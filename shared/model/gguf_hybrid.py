"""Hybrid attention + Mamba2 models (Bamba, GraniteMoeHybrid) from a `granitehybrid` GGUF file.

llama.cpp's converter writes both families as one architecture (its GraniteHybridModel) and
changes their tensors; this module turns the file back into the HF config keys and HF-named
tensors transformers has for the same model.

Metadata: the layers whose `attention.head_count_kv` entry is non-zero are attention layers, the
others Mamba2; `ssm.inner_size`/`ssm.time_step_rank` (= the mixer's head count)/
`ssm.group_count`/`ssm.state_size`/`ssm.conv_kernel` describe the mixer (the SSD chunk size
is not stored: transformers' default 256 is taken). Which family: the converter writes
Granite's multipliers (`attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`)
for every GraniteMoeHybrid (transformers saves them, 1.0 included) and never for Bamba. It
writes `rope.scaling.finetuned` = true only for Bamba: llama.cpp reads it as "apply RoPE", so
a GraniteMoeHybrid file is "nope" unless it says true (llama.cpp's default when missing).
Bamba rotates half of each head (transformers fixes partial_rotary_factor = 0.5); the file's
`rope.dimension_count` says so only when the converter's input had IBM's `attn_rotary_emb`
(else it is the whole head, which llama.cpp then rotates), so Bamba's factor is taken as 0.5.

Tensors, undoing the converter: A = -exp(A_log) back to A_log; A and D [heads, 1] and the
gated norm [groups, inner / groups] flattened; the conv1d weight [channels, kernel] given its
HF [channels, 1, kernel]; `ssm_dt.bias` is `dt_bias`; Q/K rows un-permuted (it permutes them
as for Llama); Granite's `input_linear` rows [gate; up] joined again from `ffn_gate*` and
`ffn_up*` (the shared MLP is `*_shexp` with experts, plain `ffn_*` without).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from shared.model.config import ModelConfig, UnsupportedModelError
from shared.model.gguf_names import unpermute_rope_rows

ARCH = "granitehybrid"
BAMBA = "BambaForCausalLM"
GRANITE = "GraniteMoeHybridForCausalLM"
BAMBA_PARTIAL_ROTARY = 0.5
_GRANITE_SCALES = ("attention.scale", "embedding_scale", "residual_scale", "logit_scale")

_COMMON_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}
_BAMBA_LAYER = {
    **_COMMON_LAYER,
    "ffn_norm": "pre_ff_layernorm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}
#: GraniteMoeHybrid; `input_linear` is built from a gate and an up part (see `_FUSED_PART`)
_GRANITE_LAYER = {
    **_COMMON_LAYER,
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "shared_mlp.input_linear",
    "ffn_up": "shared_mlp.input_linear",
    "ffn_down": "shared_mlp.output_linear",
    "ffn_gate_shexp": "shared_mlp.input_linear",
    "ffn_up_shexp": "shared_mlp.input_linear",
    "ffn_down_shexp": "shared_mlp.output_linear",
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.input_linear",
    "ffn_up_exps": "block_sparse_moe.input_linear",
    "ffn_down_exps": "block_sparse_moe.output_linear",
}
#: GGUF module -> its row block in Granite's fused `input_linear` (gate rows first)
_FUSED_PART = {
    "ffn_gate": 0,
    "ffn_up": 1,
    "ffn_gate_shexp": 0,
    "ffn_up_shexp": 1,
    "ffn_gate_exps": 0,
    "ffn_up_exps": 1,
}
_GLOBAL = {
    BAMBA: {"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm"},
    GRANITE: {"token_embd": "model.embed_tokens", "output_norm": "model.norm"},
}
#: `blk.N.module[.weight|.bias]`; the mixer's A and D carry no suffix
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")


def hybrid_hf_config(
    get: Callable[[str], Any],
    hidden: int,
    head_dim: int,
    layers: int,
    tensor_names: set[str],
    rope: dict[str, Any],
) -> dict[str, Any]:
    """The HF keys of a `granitehybrid` file beyond the common ones; `get(key)` reads
    `granitehybrid.<key>` (None when absent), `rope` is the file's `rope_parameters`. A missing
    `attention.scale` is llama.cpp's head_dim**-0.5."""
    kv = get("attention.head_count_kv")
    kv_per_layer = [int(n) for n in kv] if isinstance(kv, list) else []
    attention = [i for i, n in enumerate(kv_per_layer) if n]
    mamba = [i for i in range(layers) if i not in attention]
    if len(kv_per_layer) != layers or not mamba:
        # the converter writes a file without mamba layers as granite / granitemoe
        raise UnsupportedModelError(f"granitehybrid head_count_kv {kv!r}: no per-layer mamba 0s")
    n_heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if inner % hidden or inner % n_heads:
        raise UnsupportedModelError(
            f"ssm.inner_size {inner} is not a multiple of the hidden size {hidden} and of "
            f"ssm.time_step_rank {n_heads} (the mixer's heads)"
        )
    probe = mamba[0]
    hf: dict[str, Any] = {
        "num_key_value_heads": max(kv_per_layer),
        "mamba_n_heads": n_heads,
        "mamba_d_head": inner // n_heads,
        "mamba_expand": inner // hidden,
        "mamba_n_groups": int(get("ssm.group_count") or 1),
        "mamba_d_state": int(get("ssm.state_size")),
        "mamba_d_conv": int(get("ssm.conv_kernel")),
        "mamba_conv_bias": f"blk.{probe}.ssm_conv1d.bias" in tensor_names,
        "mamba_proj_bias": f"blk.{probe}.ssm_in.bias" in tensor_names,
    }
    finetuned = get("rope.scaling.finetuned")
    use_rope = True if finetuned is None else bool(finetuned)
    if not any(get(key) is not None for key in _GRANITE_SCALES):
        if not use_rope:
            raise UnsupportedModelError("granitehybrid without RoPE nor Granite scales")
        return {
            **hf,
            "architectures": [BAMBA],
            "model_type": "bamba",
            "attn_layer_indices": attention,
            "rope_parameters": {**rope, "partial_rotary_factor": BAMBA_PARTIAL_ROTARY},
        }
    experts = int(get("expert_count") or 0)
    return {
        **hf,
        "architectures": [GRANITE],
        "model_type": "granitemoehybrid",
        "layer_types": ["attention" if i in attention else "mamba" for i in range(layers)],
        "position_embedding_type": "rope" if use_rope else "nope",
        "attention_multiplier": _decimal(get("attention.scale")) or head_dim**-0.5,
        "embedding_multiplier": _decimal(get("embedding_scale")) or 1.0,
        "residual_multiplier": _decimal(get("residual_scale")) or 1.0,
        "logits_scaling": _decimal(get("logit_scale")) or 1.0,
        "num_local_experts": experts,
        "num_experts_per_tok": int(get("expert_used_count") or 0),
        "shared_intermediate_size": int(get("expert_shared_feed_forward_length") or 0),
    }


def _decimal(value: float | None) -> float | None:
    """A float32 key as the shortest decimal that rounds to it (0.2, not 0.2000000029...): the
    multiplier the HF config had, as GGUF keeps only its float32 rounding."""
    return None if value is None else float(str(np.float32(value)))


def hybrid_hf_tensors(
    tensors: Iterable[tuple[str, np.ndarray]], config: ModelConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in HF layout) from (GGUF name, array) pairs; Granite's fused
    `input_linear` is yielded once both of its parts have been read."""
    pending: dict[str, dict[int, np.ndarray]] = {}
    for gguf_name, array in tensors:
        name, part = hybrid_hf_name(gguf_name, config.architecture)
        if part is None:
            yield name, _to_hf_layout(gguf_name, array, config)
            continue
        parts = pending.setdefault(name, {})
        parts[part] = array
        if len(parts) == 2:
            yield name, np.concatenate([parts[0], parts[1]], axis=-2)
            del pending[name]
    if pending:
        raise UnsupportedModelError(f"GGUF file lacks the gate or up part of {sorted(pending)}")


def hybrid_hf_name(gguf_name: str, architecture: str) -> tuple[str, int | None]:
    """(HF name, row block within a fused `input_linear` or None) of a `granitehybrid` tensor."""
    match = _LAYER_RE.match(gguf_name)
    if match is None:
        module, _, kind = gguf_name.rpartition(".")
        if module == "output":
            return f"lm_head.{kind}", None
        if module not in _GLOBAL[architecture]:
            raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no mapping")
        return f"{_GLOBAL[architecture][module]}.{kind}", None
    layer, module, kind = match.groups()
    if module == "ssm_dt" and kind == "bias":
        return f"model.layers.{layer}.mamba.dt_bias", None
    names = _BAMBA_LAYER if architecture == BAMBA else _GRANITE_LAYER
    if module not in names:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no {architecture} mapping")
    suffix = f".{kind}" if kind else ""
    part = _FUSED_PART.get(module) if architecture == GRANITE else None
    return f"model.layers.{layer}.{names[module]}{suffix}", part


def _to_hf_layout(gguf_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    module = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if module == "ssm_a":
        return np.log(-array.reshape(-1).astype(np.float64)).astype(np.float32)
    if module in ("ssm_d", "ssm_norm"):
        return array.reshape(-1)
    if module == "ssm_conv1d" and gguf_name.endswith(".weight"):
        return array.reshape(array.shape[0], 1, array.shape[1])
    if module == "attn_q":
        return unpermute_rope_rows(array, config.num_attention_heads)
    if module == "attn_k":
        return unpermute_rope_rows(array, config.num_key_value_heads)
    return array
