"""Tiny random-weight checkpoints of every supported family, built with transformers' own
config and model classes (the reference implementation) and saved with save_pretrained, so our
loader reads them like any HF directory. tests/support/tiny_llama.py holds the Llama one and the
reference helpers (greedy generate, full-forward logits, runner construction) these reuse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from tests.support.tiny_llama import TINY_SHAPE

_BASE: dict[str, Any] = {**TINY_SHAPE, "intermediate_size": 128, "pad_token_id": 0}
_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 48}
#: a small Mamba2 mixer: 8 heads of 16 over 2 groups of a 16-wide state, conv width 4, SSD
#: chunks of 8 (transformers' reference scans prompts in chunks of this size)
_MAMBA: dict[str, Any] = {
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8, "num_hidden_layers": 4,
}  # fmt: skip

#: family -> (config class, model class, settings on top of _BASE)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        # layer 0 full, layers 1-2 slide (Qwen2's max_window_layers rule)
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 40,
         "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [1]},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_MOE, "num_experts": 6, "norm_topk_prob": True, "head_dim": 16},
    ),
}  # fmt: skip

#: hybrid attention + Mamba2 families: kept apart from FAMILIES, whose tests run one attention
#: metadata for every layer, tensor parallelism and the Triton decode chain (none of which
#: a state layer takes); make_tiny builds both kinds.
HYBRID_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # hybrid attention + Mamba2: layers mamba, attention, mamba, mamba
    "bamba": ("BambaConfig", "BambaForCausalLM", {**_MAMBA, "attn_layer_indices": [1]}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {**_MAMBA, "layer_types": ["mamba", "attention", "mamba", "mamba"],
         "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
         "shared_intermediate_size": 40, "position_embedding_type": "rope",
         "embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
         "logits_scaling": 2.0},
    ),
    # dense (no experts) and without positional embeddings ("nope")
    "granitemoehybrid_dense": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {**_MAMBA, "layer_types": ["attention", "mamba", "mamba", "attention"],
         "num_local_experts": 0, "shared_intermediate_size": 96,
         "position_embedding_type": "nope", "attention_multiplier": 0.25},
    ),
}  # fmt: skip
#: the Mamba2 mixer's per-head parameters transformers initialises deterministically (A_log =
#: log(1..H), D = 1, dt_bias = 1): randomised too, so a wrong use of one changes the logits
_MIXER_PARAMS = (".A_log", ".D", ".dt_bias")


def make_tiny(path: Path, family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Build, randomise and save a tiny `family` model; returns the transformers model.

    Norm weights are randomised too (transformers initialises them to 1, or 0 for Gemma's
    1 + w), so a q/k norm or a norm offset that we got wrong changes the logits.
    """
    config_name, model_name, family_settings = {**FAMILIES, **HYBRID_FAMILIES}[family]
    settings = {**_BASE, **family_settings, **overrides}
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**settings)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(_MIXER_PARAMS):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return model  # type: ignore[no-any-return]
