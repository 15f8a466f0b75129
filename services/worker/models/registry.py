"""Architecture name (HF `architectures[0]`) -> the model class that runs it.

Entries are import paths, not classes, so building one family never imports the others. The
names are exactly `shared.model.config.ARCHITECTURES` (the configs ModelConfig normalises): a
new family is one new module, one line here and its name there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.models.base import CausalLM
    from services.worker.models.layer_impls import LayerImpls
    from shared.model.config import ModelConfig

# The dense Llama-shaped families differ only by ModelConfig switches (q/k/v biases, q/k norms,
# sliding windows), so they share the Llama class; the MoE families share MoeForCausalLM.
_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "services.worker.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "services.worker.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "services.worker.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "services.worker.models.llama:LlamaForCausalLM",
    "Gemma3ForCausalLM": "services.worker.models.gemma:Gemma3ForCausalLM",
    "MixtralForCausalLM": "services.worker.models.moe:MoeForCausalLM",
    "Qwen2MoeForCausalLM": "services.worker.models.moe:MoeForCausalLM",
    "Qwen3MoeForCausalLM": "services.worker.models.moe:MoeForCausalLM",
    # hybrid attention + Mamba2 (a state KV cache group beside the attention group)
    "BambaForCausalLM": "services.worker.models.hybrid:BambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "services.worker.models.hybrid:GraniteMoeHybridForCausalLM",
}


def supported_architectures() -> frozenset[str]:
    return frozenset(_ARCHITECTURES)


def model_class(architecture: str) -> type[CausalLM]:
    from shared.model.config import UnsupportedModelError

    target = _ARCHITECTURES.get(architecture)
    if target is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)  # type: ignore[no-any-return]


def build_model(
    config: ModelConfig, max_model_len: int = 0, impls: LayerImpls | None = None
) -> CausalLM:
    """An un-initialised model (call under `torch.device('meta')` to allocate nothing) whose
    layers are `impls`' (layer_impls.py; None: the PyTorch reference). Its layers' own
    initialisation is skipped (skip_init.py): the caller assigns or initialises every weight."""
    from services.worker.models.layer_impls import REFERENCE
    from services.worker.models.skip_init import init_skipped

    cls = model_class(config.architecture)
    with init_skipped():
        return cls(config, max_model_len=max_model_len, impls=impls or REFERENCE)  # type: ignore[call-arg]
