"""Weights from an HF directory of safetensors files (one file or an indexed set of shards)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.parallel.shards import ShardPlan


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The shard files named by `model.safetensors.index.json`, else every *.safetensors."""
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({hf_dir / name for name in weight_map.values()})
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} holds no .safetensors weights")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"{hf_dir}: shard files missing: {missing}")
    return files


def iter_safetensors(
    hf_dir: Path, shards: ShardPlan | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of every shard, one at a time; with `shards`, only
    the tensor's part a tensor-parallel rank holds is read from the file."""
    for file in safetensors_files(hf_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, handle.get_tensor(name) if shards is None else shards.read(name, handle)
