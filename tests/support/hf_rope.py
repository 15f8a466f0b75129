"""transformers' Llama with exact RoPE frequencies, for parity tests against our forward.

`model.to(torch.bfloat16)` also casts the rotary embedding's `inv_freq` buffer, so transformers
then rotates with bf16-rounded frequencies (0.8146 -> 0.8164 for theta 5e5, head_dim 128:
angles off by up to ~0.6 rad at position 300), and a `.float()` copy of that model keeps the
rounded ones. That, not our model, was the 0.115 relative logits gap once seen at 2 layers of
the Llama-3-8B shape in fp32. `from_pretrained(torch_dtype=bf16)` keeps the buffer in fp32;
`restore_fp32_inv_freq` does the same for a model built and cast by hand.
"""

from __future__ import annotations

from typing import Any

import torch


def restore_fp32_inv_freq(model: Any) -> float:
    """Recompute `inv_freq` of every rotary embedding under `model` in fp32 from its config
    (undoing a `.to(bf16)` cast); returns the largest relative change made."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    change = 0.0
    for module in model.modules():
        if isinstance(module, LlamaRotaryEmbedding):
            old = module.inv_freq
            fresh = LlamaRotaryEmbedding(module.config).inv_freq.to(old.device, torch.float32)
            change = max(change, float(((old.float() - fresh).abs() / fresh).max()))
            module.inv_freq = fresh
    return change
