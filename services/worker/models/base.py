"""What every model family offers the runner: a flat-batch forward and logits for chosen rows.

A family (Llama now; Qwen2/3, Mistral, MoE later) subclasses `CausalLM`, so the runner, the
loaders and the bench depend on this interface, never on one family's module tree.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.attention.reference import AttentionMetadata
from services.worker.models.rope import RotaryEmbedding
from shared.model.config import ModelConfig

if TYPE_CHECKING:
    from services.worker.accel.decode_chain import DecodeChain


class CausalLM(nn.Module):
    config: ModelConfig
    max_model_len: int  # positions covered by the RoPE tables
    rotary: RotaryEmbedding
    embed_tokens: nn.Embedding
    lm_head: nn.Module | None  # None: tied, the embedding matrix projects the logits
    aux_hidden_layers: tuple[int, ...] = ()  # see forward
    # The fused forward of decode-sized steps, set at load where the model fits it
    # (services/worker/accel/decode_chain.py); None: every step runs layer by layer.
    decode_chain: DecodeChain | None = None

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | Sequence[AttentionMetadata],
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, positions [T] of one flat batch -> final hidden states [T, hidden].

        `attn` is one metadata shared by every layer, or one per layer (layers of different KV
        cache groups have different block tables and windows). A model with a non-empty
        `aux_hidden_layers` (set for EAGLE-3 drafting) returns [T, (1 + n) * hidden] instead:
        the final hidden states, then the residual stream entering each listed layer, in the
        list's order (`split_aux_hidden` takes them apart)."""

    def materialize_rotary(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compute every RoPE table of the model (some families have one per layer type)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.materialize(device, dtype)

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] of the rows being sampled -> logits [R, vocab]."""


def split_aux_hidden(
    out: torch.Tensor, hidden_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final hidden [T, H], auxiliary layer states [T, n * H] or None) of a forward's output."""
    if out.shape[-1] == hidden_size:
        return out, None
    return out[:, :hidden_size], out[:, hidden_size:]


def per_layer_metadata(
    attn: AttentionMetadata | Sequence[AttentionMetadata], num_layers: int
) -> Sequence[AttentionMetadata]:
    if not isinstance(attn, (list, tuple)):  # one metadata (either attention path's type)
        return [attn] * num_layers
    if len(attn) != num_layers:
        raise ValueError(f"{len(attn)} attention metadata for {num_layers} layers")
    return attn
