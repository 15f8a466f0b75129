"""The EAGLE-3 draft head, as vLLM (`llama_eagle3.py`) and the `speculators` library run it.

The target's feature is not its last hidden state but three of its layers' residual streams
(the input of layers `aux_layers`, by default (2, L // 2, L - 3) of an L-layer target, as
vLLM's `get_eagle3_aux_hidden_state_layers`), concatenated and fused by `fc` [H, 3·H_target]
(no bias). The first decoder layer (`midlayer` in EAGLE's own checkpoints, `layers.0` in
speculators') attends over cat(input_layernorm(embed(t[p+1])), hidden_norm(h)) [2H], so its
q/k/v projections are [., 2H]; its residual is h itself (or hidden_norm(h) with
`norm_before_residual`). Further layers, if any, are plain Llama layers. The output fed back as
the next step's h is the residual stream before the final `norm`; the logits are
lm_head(norm(.)) over the head's own draft vocabulary, whose ids reach the target through
`d2t` (vocab_map.py; `t2d` is not needed). The embedding is the target's unless the checkpoint
brings `embed_tokens`.

Config formats read here:
- EAGLE / vLLM (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a Llama config.json with
  `draft_vocab_size`, optionally `target_hidden_size` and
  `eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `midlayer.*`, `fc`, `norm`,
  `lm_head`, `d2t`, `t2d`;
- speculators (`speculators_model_type: "eagle3"`): the layer shape in
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` at the top; tensors `layers.N.*`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
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
from services.worker.models.registry import supported_architectures
from services.worker.models.rope import RotaryEmbedding
from services.worker.spec.eagle import target_embedding
from services.worker.spec.head_io import hf_tensors, load_into, read_config, save_tensors
from shared.model.config import ModelConfig

#: checkpoint tensors that are maps, not weights
_MAPS = ("d2t", "t2d")


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 layers: early, middle, late."""
    n = num_target_layers
    return (2, n // 2, n - 3)


@dataclass(frozen=True)
class Eagle3Layout:
    """What a checkpoint's config.json says about its head."""

    layer_hf: dict[str, Any]  # the decoder layers' HF config
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None  # None: the default for the target's depth
    norm_before_residual: bool

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Eagle3Layout:
        speculators = hf.get("speculators_model_type") == "eagle3"
        layer = dict(hf["transformer_layer_config"] if speculators else hf)
        if not any(a in supported_architectures() for a in layer.get("architectures") or []):
            layer["architectures"] = ["LlamaForCausalLM"]  # the layers are Llama-shaped
        eagle = hf.get("eagle_config") or {}
        aux = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        hidden = int(layer["hidden_size"])
        return cls(
            layer_hf=layer,
            draft_vocab_size=int(hf.get("draft_vocab_size") or layer["vocab_size"]),
            target_hidden_size=int(hf.get("target_hidden_size") or hidden),
            aux_layers=tuple(int(i) for i in aux) if aux else None,
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
        )


class Eagle3FirstLayer(LlamaDecoderLayer):
    """A Llama layer whose attention reads cat(normed embedding, normed feature) [2H]."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__(config, 0)
        hidden = config.hidden_size
        attn = self.self_attn
        attn.qkv_proj = nn.Linear(
            2 * hidden, attn.q_size + 2 * attn.kv_size, bias=config.attention_bias
        )
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward_first(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it), as LlamaDecoderLayer.forward returns."""
        embeds, _ = self.input_layernorm(embeds)
        normed, _ = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        out = self.self_attn(torch.cat((embeds, normed), dim=-1), cos, sin, attn, kv_cache)
        normed, residual = self.mlp_input(out, residual)
        return self.mlp_output(self.mlp(normed)), residual


class Eagle3Head(nn.Module):
    def __init__(
        self,
        layout: Eagle3Layout,
        aux_layers: tuple[int, ...],
        *,
        max_model_len: int,
        own_embedding: bool = False,
    ) -> None:
        super().__init__()
        self.layout = layout
        self.config = ModelConfig.from_hf_dict(layout.layer_hf)
        self.aux_layers = aux_layers
        hidden = self.config.hidden_size
        self.fc = nn.Linear(len(aux_layers) * layout.target_hidden_size, hidden, bias=False)
        first = Eagle3FirstLayer(self.config, layout.norm_before_residual)
        rest = (LlamaDecoderLayer(self.config, i) for i in range(1, self.config.num_hidden_layers))
        self.layers = nn.ModuleList([first, *rest])
        self.norm = RMSNorm(hidden, self.config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, layout.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(self.config.vocab_size, hidden) if own_embedding else None
        )
        self.rotary = RotaryEmbedding(
            self.config.head_dim,
            self.config.rope,
            max_model_len,
            self.config.max_position_embeddings,
        )

    @property
    def kv_config(self) -> ModelConfig:
        return self.config

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """fc over the target's auxiliary layer states [T, n·H_target] (its final hidden state
        is not used)."""
        if aux is None:
            raise ValueError("an EAGLE-3 head needs the target's auxiliary layer states")
        return self.fc(aux.to(self.fc.weight.dtype))  # type: ignore[no-any-return]

    def embed(self, token_ids: torch.Tensor, target: CausalLM) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(token_ids)  # type: ignore[no-any-return]
        return target_embedding(target, token_ids)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_caches: list[torch.Tensor],
        step: int = 0,
    ) -> torch.Tensor:
        """embeds of t[p+1], features h[p] [T, H] at head positions [T] -> the residual
        stream before the final norm (the next step's h)."""
        cos, sin = self.rotary.lookup(positions)
        first: Eagle3FirstLayer = self.layers[0]  # type: ignore[assignment]
        hidden, residual = first.forward_first(embeds, features, cos, sin, attn, kv_caches[0])
        for layer, kv_cache in zip(self.layers[1:], kv_caches[1:], strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, attn, kv_cache)
        return hidden + residual

    def draft_logits(self, g: torch.Tensor, target: CausalLM, step: int = 0) -> torch.Tensor:
        normed, _ = self.norm(g)
        logits: torch.Tensor = self.lm_head(normed)
        return logits


def load_eagle3_head(
    path: str | Path,
    num_target_layers: int,
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int,
) -> tuple[Eagle3Head, torch.Tensor | None]:
    """(head, d2t or None) from an EAGLE-3 checkpoint dir (either format, module docstring)."""
    path = Path(path)
    layout = Eagle3Layout.from_hf(read_config(path, "EAGLE-3 head"))
    aux = layout.aux_layers or default_aux_layers(num_target_layers)
    bad = [i for i in aux if not 0 <= i < num_target_layers]
    if bad:
        raise CheckpointError(
            f"{path}: EAGLE-3 auxiliary layers {bad} outside the target's {num_target_layers}"
        )
    raw = {name.replace("midlayer.", "layers.0.", 1): t for name, t in iter_safetensors(path)}
    if "fc.weight" not in raw or "layers.0.hidden_norm.weight" not in raw:
        raise CheckpointError(
            f"{path}: not an EAGLE-3 head (no fc / midlayer.hidden_norm); an EAGLE-1/2 head "
            "is MESHLLM_SPEC_METHOD=eagle"
        )
    d2t = raw.get("d2t")
    head = Eagle3Head(
        layout,
        aux,
        max_model_len=max_model_len,
        own_embedding="embed_tokens.weight" in raw or "model.embed_tokens.weight" in raw,
    )
    named = ((n, t) for n, t in raw.items() if n not in _MAPS)
    loaded = load_into(head, named, dtype, torch.device(device), f"{path}: EAGLE-3")
    assert isinstance(loaded, Eagle3Head)
    loaded.rotary.materialize(device, dtype)
    return loaded.eval().requires_grad_(False), d2t


def random_eagle3_head(
    layer_hf: dict[str, Any],
    *,
    num_target_layers: int,
    draft_vocab_size: int,
    max_model_len: int,
    seed: int = 0,
    std: float = 0.02,
    norm_before_residual: bool = False,
    aux_layers: tuple[int, ...] | None = None,
) -> Eagle3Head:
    """A head with random weights (norm scales 1), for tests; `aux_layers` None: the
    default for the target's depth."""
    layout = Eagle3Layout(
        layer_hf=copy.deepcopy(layer_hf),
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=int(layer_hf["hidden_size"]),
        aux_layers=None,
        norm_before_residual=norm_before_residual,
    )
    aux = aux_layers or default_aux_layers(num_target_layers)
    head = Eagle3Head(layout, aux, max_model_len=max_model_len)
    init_random_(head, std=std, seed=seed)
    head.rotary.materialize("cpu", torch.float32)
    return head.eval().requires_grad_(False)


def save_eagle3_head(
    head: Eagle3Head,
    path: str | Path,
    *,
    speculators: bool = False,
    d2t: torch.Tensor | None = None,
) -> None:
    """The head as its users' tools write it: EAGLE/vLLM (`midlayer.*`, Llama config.json) or
    speculators (`layers.0.*`, transformer_layer_config). Both name the auxiliary layers."""
    layout, aux = head.layout, list(head.aux_layers)
    tensors = hf_tensors(head.state_dict(), head.config)
    layer_hf = dict(layout.layer_hf)
    if speculators:
        hf: dict[str, Any] = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer_hf,
            "draft_vocab_size": layout.draft_vocab_size,
            "norm_before_residual": layout.norm_before_residual,
            "target_hidden_size": layout.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": aux,
        }
    else:
        tensors = {n.replace("layers.0.", "midlayer.", 1): t for n, t in tensors.items()}
        hf = {
            **layer_hf,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": layout.draft_vocab_size,
            "target_hidden_size": layout.target_hidden_size,
            "norm_before_residual": layout.norm_before_residual,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        }
    if d2t is not None:
        tensors["d2t"] = d2t.to(torch.int64)
    save_tensors(tensors, Path(path), hf)
