"""Draft-head checkpoints on disk: the HF spelling (q/k/v and gate/up as separate tensors) in
and out of our fused parameters, for every head (eagle.py, eagle3.py, mtp.py).

Loading is strict: a head whose tensors do not fill the module exactly (missing, unexpected or
misshapen) is a CheckpointError naming the first offenders, never a silently half-random head.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.worker.loader.checkpoint_names import FUSED, CheckpointError, assemble
from shared.model.config import ModelConfig


def read_config(path: Path, what: str) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{what} {path} has no config.json")
    return json.loads(config_file.read_text())  # type: ignore[no-any-return]


def hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict in the HF spelling (fused projections split, RoPE tables dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("rotary.") or ".rotary." in name:
            continue
        fused = next((f for f in FUSED if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor.contiguous()
            continue
        sizes = (
            [config.q_size, config.kv_size, config.kv_size]
            if fused == "qkv_proj"
            else [config.intermediate_size, config.intermediate_size]
        )
        for part, piece in zip(FUSED[fused], tensor.split(sizes), strict=True):
            out[name.replace(fused, part)] = piece.contiguous()
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, hf: dict[str, Any]) -> None:
    """config.json + model.safetensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tensors, str(path / "model.safetensors"))


def load_into(
    head: nn.Module,
    named: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    where: str,
) -> nn.Module:
    """`head` moved to dtype/device with the HF-named tensors loaded (fused as ours)."""
    weights = assemble(named, dtype, device, tie_word_embeddings=False)
    head = head.to(dtype=dtype, device=device)
    try:
        missing, unexpected = head.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # misshapen tensors (e.g. a head for another hidden size)
        raise CheckpointError(f"{where}: head weights do not fit its config: {exc}") from None
    missing = [n for n in missing if "rotary." not in n]
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: head weights missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}"
        )
    return head
