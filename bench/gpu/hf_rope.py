"""A transformers LlamaConfig that really uses a preset's RoPE theta, on any transformers 5.x.

Our presets spell RoPE the transformers-5 way, `rope_parameters: {rope_type, rope_theta}`.
Whether `LlamaConfig(**preset)` reads the theta from there has varied between releases (one
hypothesis for the 0.115 parity gap seen with transformers 5.17 on the H200; transformers 5.24
reads it). So the config is built in several spellings, each checked by the frequencies its
own rotary embedding computes, and the first that yields the preset's theta is used.

The cause of that gap found since (reproduced on CPU with transformers 5.24, 2 layers of the
8B shape, 300 tokens: 0.111): `model.to(torch.bfloat16)` also casts the rotary embedding's
`inv_freq` buffer, so transformers rotates with bf16-rounded frequencies (0.8146 -> 0.8164 for
theta 5e5, d 128: angles off by up to ~0.6 rad at position 300), and a `.float()` copy of that
model keeps the rounded ones. `restore_fp32_inv_freq` puts the fp32 frequencies back (as
`from_pretrained(torch_dtype=bf16)` keeps them).

    python3 -m bench.gpu.hf_rope            # prints the version and what each spelling yields
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import torch

from services.worker.models.random_init import PRESETS


def effective_theta(config: Any) -> float:
    """The RoPE base transformers' own LlamaRotaryEmbedding uses for `config`:
    inv_freq[1] = theta^(-2/d), so theta = inv_freq[1]^(-d/2)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    inv_freq = LlamaRotaryEmbedding(config).inv_freq
    dim = 2 * inv_freq.numel()
    return float(math.exp(-math.log(float(inv_freq[1].double())) * dim / 2))


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


def _spellings(cfg: dict[str, Any], theta: float) -> list[tuple[str, Callable[[], Any]]]:
    from transformers import LlamaConfig

    flat = {k: v for k, v in cfg.items() if k != "rope_parameters"}

    def patched() -> Any:
        config = LlamaConfig(**cfg)
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        config.rope_theta = theta
        return config

    return [
        ("rope_parameters", lambda: LlamaConfig(**cfg)),
        ("rope_parameters+rope_theta", lambda: LlamaConfig(**cfg, rope_theta=theta)),
        ("rope_theta only", lambda: LlamaConfig(**flat, rope_theta=theta)),
        ("patched after init", patched),
    ]


def hf_llama_config(preset: str = "llama-3-8b", **overrides: Any) -> tuple[Any, dict[str, Any]]:
    """(LlamaConfig with the preset's theta, report of every spelling tried)."""
    cfg = dict(PRESETS[preset], **overrides)
    for key in ("architectures", "torch_dtype"):
        cfg.pop(key, None)
    theta = float(cfg["rope_parameters"]["rope_theta"])
    report: dict[str, Any] = {"wanted_theta": theta, "spellings": {}}
    chosen = None
    for name, build in _spellings(cfg, theta):
        try:
            config = build()
            got = effective_theta(config)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            report["spellings"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        report["spellings"][name] = {
            "rope_parameters": getattr(config, "rope_parameters", None),
            "rope_theta": getattr(config, "rope_theta", None),
            "effective_theta": round(got, 1),
        }
        if chosen is None and abs(got - theta) <= 1e-3 * theta:
            chosen = (name, config)
    if chosen is None:
        raise RuntimeError(f"no LlamaConfig spelling gives theta {theta}: {report}")
    report["chosen"] = chosen[0]
    return chosen[1], report


def main() -> None:
    import transformers

    _, report = hf_llama_config()
    print(json.dumps({"transformers": transformers.__version__, **report}, indent=1, default=str))


if __name__ == "__main__":
    main()
