"""The EAGLE draft head: a one-layer Llama decoder fed the target's own features.

Shape of the public EAGLE(-1/2) checkpoints (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): at head
position p the input is `fc(cat(embed(t[p+1]), f[p]))`, where f[p] is the target's feature at
position p (the hidden state its lm_head reads, i.e. AFTER the final norm: EAGLE's ea_model takes
`outputs[0]` of the HF base model, which has applied the norm) and t[p+1] the token that
followed. `fc` is [H, 2H] (with a bias in EAGLE-1), then `num_hidden_layers` Llama decoder
layers whose first has no input norm, and no final norm: the head's output g[p] approximates
f[p+1], and the TARGET's lm_head on g[p] predicts t[p+2]. The embedding is always the target's.

EAGLE-3-style checkpoints may bring their own `lm_head` (optionally after a `norm`) over a
smaller draft vocabulary plus `d2t` offsets; those ids reach the target through the shared
vocabulary map (vocab_map.py). EAGLE-3's fused multi-layer features (`fc` [H, 3H], `midlayer`)
are not supported: loading such a checkpoint is refused with a clear error.

Parameter names are ours (q/k/v fused, gate/up fused); checkpoints are read and written in the
HF spelling through checkpoint_names.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.worker.attention.reference import AttentionMetadata
from services.worker.loader.checkpoint_names import FUSED, CheckpointError, assemble
from services.worker.loader.safetensors_loader import iter_safetensors
from services.worker.models.layers import RMSNorm
from services.worker.models.llama import LlamaDecoderLayer
from services.worker.models.random_init import init_random_
from services.worker.models.rope import RotaryEmbedding
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

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
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
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head.hf_config, indent=2))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("rotary."):
            continue
        fused = next((f for f in FUSED if f".{f}." in name), None)
        if fused is None:
            tensors[name] = tensor.contiguous()
            continue
        config = head.config
        sizes = (
            [config.q_size, config.kv_size, config.kv_size]
            if fused == "qkv_proj"
            else [config.intermediate_size, config.intermediate_size]
        )
        for part, piece in zip(FUSED[fused], tensor.split(sizes), strict=True):
            tensors[name.replace(fused, part)] = piece.contiguous()
    if d2t is not None:
        tensors["d2t"] = d2t.to(torch.int64)
    save_file(tensors, str(path / "model.safetensors"))


def load_eagle_head(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, max_model_len: int
) -> tuple[EagleHead, torch.Tensor | None]:
    """(head, d2t or None) from a dir holding config.json and *.safetensors (EAGLE names)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"EAGLE head {path} has no config.json")
    hf_config = json.loads(config_file.read_text())
    raw = dict(iter_safetensors(path))
    unsupported = [n for n in raw if n.startswith("midlayer.")]
    if unsupported:
        raise CheckpointError(
            f"{path}: EAGLE-3 fused-feature heads ({unsupported[0]}, ...) are not supported; "
            "an EAGLE-1/2 head (fc [H, 2H] + Llama layers) is"
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
    weights = assemble(
        ((n, t) for n, t in raw.items() if n not in _NOT_WEIGHTS),
        dtype,
        torch.device(device),
        tie_word_embeddings=False,
    )
    head = head.to(dtype=dtype, device=device)
    try:
        missing, unexpected = head.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # misshapen tensors (e.g. a head for another hidden size)
        raise CheckpointError(f"{path}: EAGLE head weights do not fit its config: {exc}") from None
    missing = [n for n in missing if not n.startswith("rotary.")]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: EAGLE head weights missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    head.rotary.materialize(device, dtype)
    return head.eval().requires_grad_(False), d2t
