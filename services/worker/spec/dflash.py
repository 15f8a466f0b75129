"""The DFlash draft model (block diffusion drafting), as z-lab's reference (`dflash/model.py`),
vLLM (`method: "dflash"`) and SGLang (`DFLASH`) run its checkpoints.

A DFlash draft drafts a whole block in one forward. Its context is the target's own features:
the residual streams leaving target layers `target_layer_ids` (HF `hidden_states[i + 1]`, the
stream entering layer i + 1), concatenated and fused by `fc` [H, n·H] (no bias), then
`hidden_norm`. Each draft layer is a Qwen3 layer (q/k norms, RoPE) whose keys and values come
from two sources: the context, projected by that layer's own k/v projections straight from the
fused feature (no input norm, no query, no MLP: `write_context`), and the block itself. The
block is [t[N-1], mask x K] at positions N-1 .. N-1+K (t[N-1]: the newest token, which the
target has not read yet); it runs through the layers as usual, but its attention is
non-causal: every block query sees the whole context and the whole block. The drafts are the
target's LM head over `norm` of the block's outputs at positions 1..K (the target's embedding
embeds the block; the checkpoint has neither).

Config format (config.json of z-lab/*-DFlash*): a Qwen3 config (`model_type: "qwen3"`,
`architectures: ["DFlashDraftModel"]`) with `block_size`, `num_target_layers` and
`dflash_config: {mask_token_id, target_layer_ids}`; tensors `layers.N.*`, `fc`, `hidden_norm`,
`norm`. `target_layer_ids` absent: z-lab's default spread over the target's depth.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.reference import AttentionMetadata, write_kv
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.loader.safetensors_loader import iter_safetensors
from services.worker.models.layers import RMSNorm
from services.worker.models.llama import LlamaAttention, LlamaDecoderLayer
from services.worker.models.random_init import init_random_
from services.worker.models.rope import RotaryEmbedding, apply_rotary
from services.worker.spec.head_io import hf_tensors, load_into, read_config, save_tensors
from shared.model.config import ModelConfig


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's `build_target_layer_ids`: one target layer per draft layer, evenly from layer 1
    to layer L - 3 (the middle one for a one-layer draft)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashLayout:
    """What a checkpoint's config.json says about its draft."""

    layer_hf: dict[str, Any]  # the draft layers' HF config (Qwen3)
    block_size: int  # the block it was trained on: [bonus, mask x (block_size - 1)]
    mask_token_id: int
    target_layers: tuple[int, ...] | None  # None: default_target_layers
    target_hidden_size: int

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DFlashLayout:
        dflash = hf.get("dflash_config") or {}
        if "mask_token_id" not in dflash or "block_size" not in hf:
            raise CheckpointError(
                "not a DFlash draft: config.json needs `block_size` and "
                "`dflash_config.mask_token_id`"
            )
        layer = {**hf, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
        layers = dflash.get("target_layer_ids")
        return cls(
            layer_hf=layer,
            block_size=int(hf["block_size"]),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layers=tuple(int(i) for i in layers) if layers else None,
            target_hidden_size=int(hf.get("target_hidden_size") or hf["hidden_size"]),
        )


class DFlashHead(nn.Module):
    def __init__(self, layout: DFlashLayout, target_layers: tuple[int, ...], max_model_len: int):
        super().__init__()
        self.layout = layout
        self.config = ModelConfig.from_hf_dict(layout.layer_hf)
        if self.config.sliding_window is not None:
            raise CheckpointError("a DFlash draft with sliding-window layers is not supported")
        self.target_layers = target_layers
        hidden = self.config.hidden_size
        self.fc = nn.Linear(len(target_layers) * layout.target_hidden_size, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, self.config.rms_norm_eps)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(self.config, i) for i in range(self.config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, self.config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            self.config.head_dim,
            self.config.rope,
            max_model_len,
            self.config.max_position_embeddings,
        )

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose entering residual stream the target must return
        (CausalLM.aux_hidden_layers): the stream leaving layer i enters layer i + 1."""
        return tuple(i + 1 for i in self.target_layers)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """The fused context feature [T, H] from the target's auxiliary states [T, n·H]."""
        normed, _ = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        return normed  # type: ignore[no-any-return]

    def write_context(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_caches: list[torch.Tensor],
    ) -> None:
        """Each layer's keys/values of the context rows [T, H] at `positions`, into `slots`."""
        for (k, v), kv_cache in zip(self.context_kv(context, positions), kv_caches, strict=True):
            write_kv(kv_cache, k.to(kv_cache.dtype), v, slots)

    def context_kv(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the rotated keys and the values [T, kv_heads, d] of the context rows
        [T, H] at `positions`: that layer's k/v projections straight from the fused feature
        (no input norm), its k norm where it has one."""
        cos, sin = self.rotary.lookup(positions)
        tokens = context.shape[0]
        out = []
        for layer in self.layers:
            attn: LlamaAttention = layer.self_attn  # type: ignore[assignment]
            proj = attn.qkv_proj
            bias = proj.bias[attn.q_size :] if proj.bias is not None else None
            kv = F.linear(context, proj.weight[attn.q_size :], bias)
            k = kv[:, : attn.kv_size].reshape(tokens, attn.num_kv_heads, attn.head_dim)
            v = kv[:, attn.kv_size :].reshape(tokens, attn.num_kv_heads, attn.head_dim)
            if attn.k_norm is not None:
                k, _ = attn.k_norm(k)
            out.append((apply_rotary(k, cos, sin), v))
        return out

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """The blocks' embeddings [T, H] at `positions` -> normed outputs [T, H] (attention
        non-causal within each row: `attn` comes from a non-causal RowKV)."""
        cos, sin = self.rotary.lookup(positions)
        hidden, residual = embeds, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, attn, kv_cache)
        out, _ = self.norm(hidden, residual)
        return out  # type: ignore[no-any-return]


def _target_layers(layout: DFlashLayout, num_target_layers: int, where: str) -> tuple[int, ...]:
    num_draft = int(layout.layer_hf["num_hidden_layers"])
    layers = layout.target_layers or default_target_layers(num_target_layers, num_draft)
    # the stream leaving the last layer is not an auxiliary state (the final norm follows)
    bad = [i for i in layers if not 0 <= i < num_target_layers - 1]
    if bad:
        raise CheckpointError(
            f"{where}: DFlash target layers {bad} outside 0..{num_target_layers - 2} of the "
            f"target's {num_target_layers}"
        )
    return layers


def load_dflash_head(
    path: str | Path,
    num_target_layers: int,
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int,
) -> DFlashHead:
    path = Path(path)
    layout = DFlashLayout.from_hf(read_config(path, "DFlash draft"))
    head = DFlashHead(layout, _target_layers(layout, num_target_layers, str(path)), max_model_len)
    loaded = load_into(head, iter_safetensors(path), dtype, torch.device(device), f"{path}: DFlash")
    assert isinstance(loaded, DFlashHead)
    loaded.rotary.materialize(device, dtype)
    return loaded.eval().requires_grad_(False)


def random_dflash_head(
    layer_hf: dict[str, Any],
    *,
    num_target_layers: int,
    block_size: int,
    mask_token_id: int,
    max_model_len: int,
    target_layers: tuple[int, ...] | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> DFlashHead:
    """A draft with random weights (norm scales 1), for tests; `layer_hf` a Qwen3 config."""
    hf = {
        **copy.deepcopy(layer_hf),
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id},
    }
    if target_layers is not None:
        hf["dflash_config"]["target_layer_ids"] = list(target_layers)
    layout = DFlashLayout.from_hf(hf)
    head = DFlashHead(layout, _target_layers(layout, num_target_layers, "random"), max_model_len)
    init_random_(head, std=std, seed=seed)
    head.rotary.materialize("cpu", torch.float32)
    return head.eval().requires_grad_(False)


def save_dflash_head(head: DFlashHead, path: str | Path, *, num_target_layers: int) -> None:
    """The draft as z-lab's checkpoints are laid out (Qwen3 config + dflash_config)."""
    layout = head.layout
    hf = {
        **layout.layer_hf,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": layout.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": layout.mask_token_id,
            "target_layer_ids": list(head.target_layers),
        },
    }
    save_tensors(hf_tensors(head.state_dict(), head.config), Path(path), hf)
