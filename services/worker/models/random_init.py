"""Models with random weights at real sizes, built directly on the device (benchmarks).

Speed does not depend on the weights' values, so an 8B-shaped model needs no 16 GB checkpoint:
the architecture is built on the meta device, its parameters are allocated on the target device
in the serving dtype, and filled there (normal(0, std) for matrices, 1 for norm scales, 0 for
biases). Any architecture the registry knows can be built this way, from a preset name or an HF
`config.json`.

The worker serves such a model with `MESHLLM_MODEL=random:<preset or path to config.json>`; it
has no tokenizer, so clients submit token ids (SubmitRequest.prompt_token_ids on the bus).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.worker.loader import (
    finish_loading,
    layer_impls_for,
    prepare_for_device,
    resolve_dtype,
)
from services.worker.models.base import CausalLM
from services.worker.models.layer_impls import LayerImpls
from services.worker.models.registry import build_model
from shared.model.config import ModelConfig
from shared.model.source import ModelSource

RANDOM_SCHEME = "random:"

#: HF config dicts of real models (shapes only; no weights exist for these). RoPE is spelled
#: as transformers 5 `rope_parameters`: a bare `rope_theta` is dropped by some 5.x versions,
#: which then build a different model from the same dict.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}


def is_random_spec(model: str | Path) -> bool:
    return str(model).startswith(RANDOM_SCHEME)


def random_hf_config(spec: str) -> dict[str, Any]:
    """The HF config dict named by `random:<preset>` or `random:<path to config.json or dir>`."""
    name = spec.removeprefix(RANDOM_SCHEME)
    if name in PRESETS:
        return dict(PRESETS[name])
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"{spec!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a config.json file"
        )
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def random_source(spec: str, served_name: str = "") -> ModelSource:
    """A ModelSource whose path keeps the `random:` spec (the worker builds, never loads, it)."""
    random_hf_config(spec)  # fail at resolution, not later at load time
    label = Path(spec.removeprefix(RANDOM_SCHEME)).name.removesuffix(".json")
    return ModelSource(served_name or f"random-{label}", Path(spec), Path(spec))


def init_random_(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Fill every parameter in place: norm scales 1, biases 0, other tensors normal(0, std).

    The generator lives on the parameters' device, so an 8B model fills in well under a second
    on a GPU and no host copy of the weights ever exists."""
    generator: torch.Generator | None = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)


def build_random_model(
    config: ModelConfig | dict[str, Any],
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int = 0,
    std: float = 0.02,
    seed: int = 0,
    compiled: bool = False,
    impls: LayerImpls | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """(model in eval mode on `device` with random weights, its config); `compiled` and
    `impls` as in load_model."""
    if not isinstance(config, ModelConfig):
        config = ModelConfig.from_hf_dict(config)
    device = torch.device(device)
    impls = impls or layer_impls_for(device)
    with torch.device("meta"):
        model = build_model(config, max_model_len=max_model_len, impls=impls).to(dtype)
    model = model.to_empty(device=device)  # allocated once, in the serving dtype
    init_random_(model, std=std, seed=seed)
    # Every RoPE table (families with per-layer-type tables name theirs in materialize_rotary).
    materialize = getattr(model, "materialize_rotary", None) or model.rotary.materialize
    materialize(device, dtype)
    prepare_for_device(model, dtype, device, compiled)  # the layout a loaded model gets
    finish_loading(model, impls)
    return model, config


def load_random_model(
    spec: str,
    dtype: torch.dtype | str,
    device: torch.device | str,
    max_model_len: int = 0,
    compiled: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """`random:<preset or config.json>` built like load_model builds a checkpoint ('auto' dtype
    is the config's torch_dtype, with load_model's CPU rule)."""
    config = ModelConfig.from_hf_dict(random_hf_config(spec))
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    return build_random_model(
        config, torch_dtype, device, max_model_len=max_model_len, compiled=compiled
    )
