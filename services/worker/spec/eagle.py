"""The EAGLE draft head: a one-layer Llama decoder fed the target's own features.

Shape of the public EAGLE(-1/2) checkpoints (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): at head
position p the input is `fc(cat(embed(t[p+1]), f[p]))`, where f[p] is the target's feature at
position p (the hidden state its lm_head reads, i.e. AFTER the final norm: EAGLE's ea_model takes
`outputs[0]` of the HF base model, which has applied the norm) and t[p+1] the token that
followed. `fc` is [H, 2H] (with a bias in EAGLE-1), then `num_hidden_layers` Llama decoder
layers whose first has no input norm, and no final norm: the head's output g[p] approximates
f[p+1], and the TARGET's lm_head on g[p] predicts t[p+2]. The embedding is always the target's.

Some checkpoints bring their own `lm_head` (optionally after a `norm`) over a smaller draft
vocabulary plus `d2t` offsets; those ids reach the target through the shared vocabulary map
(vocab_map.py). EAGLE-3 heads (`fc` [H, 3H] over fused multi-layer features, a `midlayer`) are
eagle3.py's: loading one here is refused with an error that says so.

Parameter names are ours (q/k/v fused, gate/up fused); checkpoints are read and written in the
HF spelling through checkpoint_names.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.loader.safetensors_loader import iter_safetensors
from services.worker.models.base import CausalLM
from services.worker.models.layers import RMSNorm
from services.worker.models.llama import LlamaDecoderLayer
from services.worker.models.random_init import init_random_
from services.worker.models.rope import RotaryEmbedding
from services.worker.spec.head_io import hf_tensors, load_into, read_config, save_tensors
from shared.model.config import ModelConfig

#: checkpoint tensors the head does not own (the embedding is the target's; d2t/t2d are maps)
_NOT_WEIGHTS = ("embed_tokens.weight", "model.embed_tokens.weight", "d2t", "t2d")


class _NoNorm(nn.Module):
    """EAGLE's first layer has no input norm: the residual add only (RMSNorm's signature)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return x, x


class EagleHead(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        *,
        max_model_len: int,
        fc_bias: bool = True,
        first_layer_norm: bool = False,
        draft_vocab_size: int = 0,
        final_norm: bool = False,
    ) -> None:
        """`draft_vocab_size` 0: the target's lm_head projects the logits (EAGLE-1); otherwise
        the head's own lm_head (after `norm` when `final_norm`)."""
        super().__init__()
        self.hf_config = dict(hf_config)
        self.config = ModelConfig.from_hf_dict(hf_config)
        hidden = self.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(self.config, i) for i in range(self.config.num_hidden_layers)
        )
        if not first_layer_norm:
            self.layers[0].input_layernorm = _NoNorm()
        self.norm: RMSNorm | None = (
            RMSNorm(hidden, self.config.rms_norm_eps) if final_norm and draft_vocab_size else None
        )
        self.lm_head: nn.Linear | None = (
            nn.Linear(hidden, draft_vocab_size, bias=False) if draft_vocab_size else None
        )
        self.rotary = RotaryEmbedding(
            self.config.head_dim,
            self.config.rope,
            max_model_len,
            self.config.max_position_embeddings,
        )

    @property
    def draft_vocab_size(self) -> int:
        """0 when the target's lm_head projects (the draft vocabulary is the target's)."""
        return self.lm_head.out_features if self.lm_head is not None else 0

    @property
    def kv_config(self) -> ModelConfig:
        return self.config

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """EAGLE reads the target's final hidden state (after its norm)."""
        return hidden

    def embed(self, token_ids: torch.Tensor, target: CausalLM) -> torch.Tensor:
        return target_embedding(target, token_ids)

    def draft_logits(self, g: torch.Tensor, target: CausalLM, step: int = 0) -> torch.Tensor:
        """The head's own lm_head (draft vocabulary) where it has one, else the target's."""
        if self.lm_head is not None:
            return self.own_logits(g)
        return target.compute_logits(g)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_caches: list[torch.Tensor],
        step: int = 0,
    ) -> torch.Tensor:
        """embeds, features [T, H] (of t[p+1] and f[p]) at head positions [T] -> g [T, H]."""
        hidden = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        cos, sin = self.rotary.lookup(positions)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, attn, kv_cache)
        assert residual is not None
        return hidden + residual  # EAGLE has no final norm before the (target's) lm_head

    def own_logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from the head's own lm_head (only when it has one)."""
        assert self.lm_head is not None
        if self.norm is not None:
            g, _ = self.norm(g)
        logits: torch.Tensor = self.lm_head(g)
        return logits


def target_embedding(target: CausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """The target's input embedding of `token_ids` (its own scaling included, e.g. Gemma's)."""
    embed = getattr(target, "embed", target.embed_tokens)
    return embed(token_ids)  # type: ignore[no-any-return]


def random_eagle_head(
    hf_config: dict[str, Any],
    *,
    max_model_len: int,
    seed: int = 0,
    std: float = 0.02,
    draft_vocab_size: int = 0,
) -> EagleHead:
    """A head with random weights (norm scales 1, biases 0), for shape and correctness tests."""
    head = EagleHead(
        hf_config,
        max_model_len=max_model_len,
        draft_vocab_size=draft_vocab_size,
        final_norm=bool(draft_vocab_size),
    )
    init_random_(head, std=std, seed=seed)
    head.rotary.materialize("cpu", torch.float32)
    return head.eval().requires_grad_(False)


def save_eagle_head(head: EagleHead, path: str | Path, d2t: torch.Tensor | None = None) -> None:
    """config.json + model.safetensors in the HF/EAGLE spelling (q/k/v, gate/up split)."""
    tensors = hf_tensors(head.state_dict(), head.config)
    if d2t is not None:
        tensors["d2t"] = d2t.to(torch.int64)
    save_tensors(tensors, Path(path), head.hf_config)


def load_eagle_head(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, max_model_len: int
) -> tuple[EagleHead, torch.Tensor | None]:
    """(head, d2t or None) from a dir holding config.json and *.safetensors (EAGLE names)."""
    path = Path(path)
    hf_config = read_config(path, "EAGLE head")
    raw = dict(iter_safetensors(path))
    unsupported = [n for n in raw if n.startswith("midlayer.")]
    if unsupported:
        raise CheckpointError(
            f"{path}: an EAGLE-3 head ({unsupported[0]}, ...): serve it with "
            "MESHLLM_SPEC_METHOD=eagle3 (eagle reads EAGLE-1/2 heads: fc [H, 2H] + Llama layers)"
        )
    d2t = raw.get("d2t")
    lm_head = raw.get("lm_head.weight")
    head = EagleHead(
        hf_config,
        max_model_len=max_model_len,
        fc_bias="fc.bias" in raw,
        first_layer_norm="layers.0.input_layernorm.weight" in raw,
        draft_vocab_size=int(lm_head.shape[0]) if lm_head is not None else 0,
        final_norm="norm.weight" in raw,
    )
    named = ((n, t) for n, t in raw.items() if n not in _NOT_WEIGHTS)
    loaded = load_into(head, named, dtype, torch.device(device), f"{path}: EAGLE")
    assert isinstance(loaded, EagleHead)
    loaded.rotary.materialize(device, dtype)
    return loaded.eval().requires_grad_(False), d2t
