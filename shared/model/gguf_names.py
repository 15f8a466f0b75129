"""llama.cpp tensor names -> HF tensor names, and the layout changes llama.cpp's converter makes.

What convert_hf_to_gguf.py does to a checkpoint, and what is undone here:
- renames (`blk.N.attn_q.weight`); the HF name depends on the architecture only for Gemma3,
  whose `ffn_norm` is the pre-feedforward norm (elsewhere it is the post-attention norm);
- permutes the rows of Q and K for the `llama` architecture only (Llama, Mistral, Mixtral), so
  its RoPE kernel can rotate adjacent pairs; qwen2/qwen3/qwen*moe/gemma3 are written unpermuted
  (their llama.cpp graphs use the neox rotation, as we do);
- stacks the experts of a MoE layer into one [E, rows, cols] tensor (`ffn_gate_exps`, ...),
  split here back into per-expert HF names that `checkpoint_names.assemble` stacks again;
- stores Gemma's norm weights as `1 + w` (llama.cpp's RMSNorm multiplies by the weight, Gemma's
  by 1 + weight), so 1 is subtracted again.
"""

from __future__ import annotations

import re

import numpy as np

from shared.model.config import UnsupportedModelError

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # MoE: router and Qwen2-MoE's shared expert with its sigmoid gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: Gemma3's four norms per layer (its `ffn_norm` comes before the MLP)
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Mixtral (llama architecture with experts) keeps its own HF spelling, so that a converted
#: directory is a Mixtral checkpoint transformers can read
_MIXTRAL_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"}
#: stacked expert tensors -> the per-expert HF module (Qwen-MoE, Mixtral spelling)
EXPERT_NAMES = {
    "ffn_gate_exps": ("mlp", "gate_proj", "w1"),
    "ffn_up_exps": ("mlp", "up_proj", "w3"),
    "ffn_down_exps": ("mlp", "down_proj", "w2"),
}
#: architectures whose converter permutes Q/K rows (llama.cpp's LlamaModel and its subclasses)
PERMUTED_ARCHS = frozenset({"llama"})
#: architectures whose norm weights are stored as 1 + w
NORM_PLUS_ONE_ARCHS = frozenset({"gemma3"})

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor, or None for tensors we derive (e.g. rope_freqs).

    Stacked expert tensors have no single HF name: see `expert_hf_names`."""
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, module, kind = match.groups()
        names = _LAYER_NAMES
        if arch == "gemma3":
            names = _GEMMA_LAYER_NAMES
        elif arch == "llama":
            names = _MIXTRAL_LAYER_NAMES
        if module not in names:
            raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no mapping")
        return f"model.layers.{layer}.{names[module]}.{kind}"
    module, _, kind = gguf_name.rpartition(".")
    if module == "rope_freqs":
        return None
    if module not in _GLOBAL_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no mapping")
    return f"{_GLOBAL_NAMES[module]}.{kind}"


def expert_hf_names(gguf_name: str, num_experts: int, arch: str = "") -> list[str] | None:
    """Per-expert HF names (expert order) of a stacked expert tensor; None if it is not one."""
    match = _LAYER_RE.match(gguf_name)
    if not match or match[2] not in EXPERT_NAMES or match[3] != "weight":
        return None
    module, part, mixtral_part = EXPERT_NAMES[match[2]]
    if arch == "llama":
        module, part = "block_sparse_moe", mixtral_part
    prefix = f"model.layers.{match[1]}.{module}.experts"
    return [f"{prefix}.{e}.{part}.weight" for e in range(num_experts)]


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)` on the rows of a Q or K projection."""
    rows = weight.shape[0]
    # llama.cpp: reshape(heads, 2, rows/heads/2, ...).swapaxes(1, 2); this swaps back.
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def to_hf_layout(
    arch: str, name: str, array: np.ndarray, num_heads: int, num_kv_heads: int
) -> np.ndarray:
    """Undo the converter's value changes on one tensor (already renamed to `name`)."""
    if arch in PERMUTED_ARCHS:
        if ".q_proj." in name:
            return unpermute_rope_rows(array, num_heads)
        if ".k_proj." in name:
            return unpermute_rope_rows(array, num_kv_heads)
    if arch in NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight"):
        return array - 1.0
    return array
