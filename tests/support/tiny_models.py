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


def make_tiny(path: Path, family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Build, randomise and save a tiny `family` model; returns the transformers model.

    Norm weights are randomised too (transformers initialises them to 1, or 0 for Gemma's
    1 + w), so a q/k norm or a norm offset that we got wrong changes the logits.
    """
    config_name, model_name, family_settings = FAMILIES[family]
    settings = {**_BASE, **family_settings, **overrides}
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**settings)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return model  # type: ignore[no-any-return]
