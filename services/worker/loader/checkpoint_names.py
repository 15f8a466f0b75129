"""Checkpoint tensor names (HF spelling) -> our parameter names, with fused projections.

Both loaders reduce their input to HF-named tensors (the GGUF loader renames llama.cpp names
first), so the mapping onto our modules lives in one place. Fused parameters are concatenated
along the output dimension in the order listed in `FUSED` — the same order the model splits them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

#: our fused module -> the checkpoint modules it concatenates, in row order
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PART_OF = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}

#: per-expert checkpoint tensors (Mixtral's w1/w3/w2, Qwen-MoE's gate/up/down) -> our stacked
#: expert parameter and the part's row block within one expert
_EXPERT_PART = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
    "down_proj": ("down_proj", 0),
}
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
#: module renames onto our tree (Mixtral's sparse block is our `mlp`)
_RENAMES = ((".block_sparse_moe.", ".mlp."),)


class CheckpointError(ValueError):
    """The checkpoint's tensors do not fit the model (missing, unexpected or misshapen)."""


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layer_index(hf_name: str, num_hidden_layers: int) -> int | None:
    """k when `hf_name` belongs to MTP module k of a model with `num_hidden_layers` decoder
    layers (DeepSeek-V3's spelling: `model.layers.{num_hidden_layers + k}.*`), else None. The
    model's loader skips these; services/worker/spec/mtp.py reads them."""
    match = _LAYER.match(hf_name)
    if match is None or int(match[1]) < num_hidden_layers:
        return None
    return int(match[1]) - num_hidden_layers


def our_name(hf_name: str) -> tuple[str, str, int] | None:
    """(our parameter name, fused module or '', shard index) for an HF name; None to skip.

    Skipped: rotary inverse-frequency buffers that some old checkpoints carry (we derive them).
    """
    if "rotary_emb.inv_freq" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
    for old, new in _RENAMES:
        name = name.replace(old, new)
    pieces = name.split(".")
    for i, piece in enumerate(pieces):
        if piece in _PART_OF:
            fused, shard = _PART_OF[piece]
            pieces[i] = fused
            return ".".join(pieces), fused, shard
    return name, "", 0


def assemble(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    tie_word_embeddings: bool,
) -> dict[str, torch.Tensor]:
    """Our state dict from HF-named tensors: renamed, fused, cast, moved.

    Each tensor is cast and moved as it arrives, so peak memory is about one tensor in the
    checkpoint's dtype beyond the model itself (plus the parts of one fused group).
    """
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for hf_name, tensor in named_tensors:
        expert = _EXPERT.match(hf_name.removeprefix("model.").replace(*_RENAMES[0]))
        if expert and expert["part"] in _EXPERT_PART:
            target, row_block = _EXPERT_PART[expert["part"]]
            parts = experts.setdefault(f"{expert['prefix']}.{target}", {})
            parts[(int(expert["expert"]), row_block)] = tensor.to(device=device, dtype=dtype)
            continue
        mapped = our_name(hf_name)
        if mapped is None:
            continue
        name, fused, shard = mapped
        if tie_word_embeddings and name == "lm_head.weight":
            continue  # some tied checkpoints store a copy; the embedding is the source of truth
        tensor = tensor.to(device=device, dtype=dtype)
        if not fused:
            out[name] = tensor
            continue
        parts = pending.setdefault(name, {})
        parts[shard] = tensor
        if len(parts) == len(FUSED[fused]):
            out[name] = torch.cat([parts[i] for i in range(len(parts))], dim=0)
            del pending[name]
    if pending:
        raise CheckpointError(f"incomplete fused weights: {sorted(pending)}")
    for name, parts in experts.items():
        out[name] = _stack_experts(name, parts)
    return out


def _stack_experts(name: str, parts: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """[E, rows, cols] from per-expert parts keyed (expert, row block); every expert must
    bring every row block (gate and up for gate_up_proj)."""
    num_experts = max(e for e, _ in parts) + 1
    blocks = max(b for _, b in parts) + 1
    missing = [(e, b) for e in range(num_experts) for b in range(blocks) if (e, b) not in parts]
    if missing:
        raise CheckpointError(f"{name}: expert weights missing for (expert, part) {missing[:4]}")
    return torch.stack(
        [torch.cat([parts[(e, b)] for b in range(blocks)], dim=0) for e in range(num_experts)]
    )
