"""Checkpoint tensor names (HF spelling) -> our parameter names, with fused projections.

Both loaders reduce their input to HF-named tensors (the GGUF loader renames llama.cpp names
first), so the mapping onto our modules lives in one place. Fused parameters are concatenated
along the output dimension in the order listed in `FUSED` — the same order the model splits them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: our fused module -> the checkpoint modules it concatenates, in row order
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PART_OF = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}


class CheckpointError(ValueError):
    """The checkpoint's tensors do not fit the model (missing, unexpected or misshapen)."""


def our_name(hf_name: str) -> tuple[str, str, int] | None:
    """(our parameter name, fused module or '', shard index) for an HF name; None to skip.

    Skipped: rotary inverse-frequency buffers that some old checkpoints carry (we derive them).
    """
    if "rotary_emb.inv_freq" in hf_name:
        return None
    name = hf_name.removeprefix("model.")
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
    for hf_name, tensor in named_tensors:
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
    return out
