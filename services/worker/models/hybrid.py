"""Hybrid attention + Mamba2 decoders: Bamba and GraniteMoeHybrid.

Each layer is either a Mamba2 mixer (mamba2.py; its cache is a recurrent state in the state
group's blocks) or the Llama attention (paged K/V, with these families' RoPE switches), then
an MLP. Per step the runner hands every layer its metadata (attention metadata or the state
layers' `StateMetadata`) and its cache (K/V tensor or `MambaState`), one per layer.

- Bamba: attention layers at `attn_layer_indices`, partial RoPE (factor 0.5), a SwiGLU
  `feed_forward` after `pre_ff_layernorm`, `final_layernorm`.
- GraniteMoeHybrid: `layer_types`; muP multipliers (embeddings x embedding_multiplier,
  attention scale = attention_multiplier, each sub-layer output x residual_multiplier,
  logits / logits_scaling); RoPE or none ("nope"); a dense `shared_mlp` plus, when the config
  has experts, a top-k MoE (checkpoint `block_sparse_moe`, our `mlp` after the loader's rename).

Module and parameter names follow the checkpoints (q/k/v and gate/up fused by the loader).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.state_metadata import StateMetadata
from services.worker.models.base import CausalLM, per_layer_metadata
from services.worker.models.layer_impls import REFERENCE, LayerImpls
from services.worker.models.layers import ACTIVATIONS
from services.worker.models.llama import LlamaAttention
from services.worker.models.mamba2 import Mamba2Mixer
from services.worker.models.moe import experts_grouped, route
from services.worker.models.rope import RotaryEmbedding
from services.worker.runner.routed_experts import RoutedExpertsRecorder
from services.worker.runner.state_cache import MambaState
from shared.model.config import ModelConfig, UnsupportedModelError


class HybridDecoderLayer(nn.Module):
    """norm -> (mamba | attention) -> norm -> MLP, with the residual adds fused into the norms
    (each returns (MLP output, residual stream); the next layer's input norm adds them)."""

    def __init__(self, config: ModelConfig, layer_idx: int, impls: LayerImpls) -> None:
        super().__init__()
        self.is_mamba = config.layer_types[layer_idx] == "mamba"
        if self.is_mamba:
            self.mamba = Mamba2Mixer(config, impls)
        else:
            self.self_attn = LlamaAttention(config, impls)
            if config.attention_multiplier is not None:
                self.self_attn.scale = config.attention_multiplier
        self.input_layernorm = impls.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def mix(
        self,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata | StateMetadata,
        cache: torch.Tensor | MambaState,
    ) -> torch.Tensor:
        if self.is_mamba:
            assert isinstance(meta, StateMetadata) and isinstance(cache, MambaState)
            return self.mamba(normed, meta, cache)  # type: ignore[no-any-return]
        assert isinstance(cache, torch.Tensor)
        return self.self_attn(normed, cos, sin, meta, cache)  # type: ignore[no-any-return]

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata | StateMetadata,
        cache: torch.Tensor | MambaState,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm(hidden, residual)
        out = self.scaled(self.mix(normed, cos, sin, meta, cache))
        normed, residual = self.post_norm(out, residual)
        return self.scaled(self.feed(normed)), residual

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier

    def post_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def feed(self, normed: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class BambaDecoderLayer(HybridDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, impls: LayerImpls) -> None:
        super().__init__(config, layer_idx, impls)
        self.pre_ff_layernorm = impls.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = impls.gated_mlp(
            config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act
        )

    def post_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pre_ff_layernorm(x, residual)  # type: ignore[no-any-return]

    def feed(self, normed: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(normed)  # type: ignore[no-any-return]


class _Weight(nn.Module):
    """A module holding one parameter called `weight` (checkpoint names `<module>.weight`)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class _Router(nn.Module):
    """GraniteMoeHybrid's router (checkpoint `router.layer.weight` [experts, hidden])."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.layer = _Weight(experts, hidden)


class GraniteSharedMLP(nn.Module):
    """GraniteMoeHybrid's dense MLP: `input_linear` rows [gate; up], `output_linear`."""

    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.inter = inter
        self.act = ACTIVATIONS[act]
        self.input_linear = _Weight(2 * inter, hidden)
        self.output_linear = _Weight(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.input_linear.weight).split(self.inter, dim=-1)
        return F.linear(self.act(gate) * up, self.output_linear.weight)


class GraniteMoe(nn.Module):
    """GraniteMoeHybrid's routed experts: softmax over the top-k router logits; experts stacked
    as `input_linear` [E, 2I, H] (rows [gate; up]) and `output_linear` [E, H, I]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        inter = config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.act = config.hidden_act
        self.router = _Router(experts, hidden)
        self.input_linear = _Weight(experts, 2 * inter, hidden)
        self.output_linear = _Weight(experts, hidden, inter)
        # Set by the model: where this block's routed ids go, and its index among MoE layers.
        self.recorder: RoutedExpertsRecorder | None = None
        self.moe_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.router.layer.weight), self.top_k, renormalize=True)
        if self.recorder is not None:
            self.recorder.record(self.moe_index, ids)
        if x.is_cuda and self.act == "silu":  # the fused-MoE kernel (SwiGLU), as moe.py does:
            # no host sync, so graph-capturable
            from meshllm_kernels.layers.fused_moe import fused_moe

            return fused_moe(x, self.input_linear.weight, self.output_linear.weight, weights, ids)
        return experts_grouped(
            x, self.input_linear.weight, self.output_linear.weight, weights, ids, self.act
        )


class GraniteMoeHybridDecoderLayer(HybridDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, impls: LayerImpls) -> None:
        super().__init__(config, layer_idx, impls)
        self.post_attention_layernorm = impls.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.shared_mlp = GraniteSharedMLP(
            config.hidden_size, config.shared_mlp_intermediate_size, config.hidden_act
        )
        self.mlp = GraniteMoe(config) if config.num_experts else None

    def post_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.post_attention_layernorm(x, residual)  # type: ignore[no-any-return]

    def feed(self, normed: torch.Tensor) -> torch.Tensor:
        shared = self.shared_mlp(normed)
        return shared if self.mlp is None else self.mlp(normed) + shared


class HybridForCausalLM(CausalLM):
    decoder_layer_cls: type[HybridDecoderLayer] = HybridDecoderLayer
    final_norm_name = "norm"

    def __init__(
        self, config: ModelConfig, max_model_len: int = 0, impls: LayerImpls = REFERENCE
    ) -> None:
        super().__init__()
        if config.mamba is None:
            raise UnsupportedModelError(f"{config.architecture}: no Mamba2 mixer config")
        self.config = config
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.embed_tokens = impls.embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i, impls) for i in range(config.num_hidden_layers)
        )
        setattr(self, self.final_norm_name, impls.rms_norm(config.hidden_size, config.rms_norm_eps))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else impls.lm_head(config.hidden_size, config.vocab_size)
        )
        self.gather_logits = impls.gather_logits
        self.decode_chain = None
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope, self.max_model_len, config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | Sequence[AttentionMetadata | StateMetadata],
        kv_caches: Sequence[torch.Tensor | MambaState],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        cos, sin = self.rotary.lookup(positions)
        if not self.config.use_rope:  # "nope": the rotation is the identity
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        metas = per_layer_metadata(attn, len(self.layers))  # type: ignore[arg-type]
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} caches for {len(self.layers)} layers")
        residual: torch.Tensor | None = None
        for layer, meta, cache in zip(self.layers, metas, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, meta, cache)
        hidden, _ = getattr(self, self.final_norm_name)(hidden, residual)
        return hidden  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return self.gather_logits(logits, self.config.vocab_size)  # type: ignore[no-any-return]


class BambaForCausalLM(HybridForCausalLM):
    decoder_layer_cls = BambaDecoderLayer
    final_norm_name = "final_layernorm"


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """`routed_experts` (MoE configs) records each MoE layer's top-k ids during a forward when
    the runner starts it (services/worker/runner/routed_experts.py)."""

    decoder_layer_cls = GraniteMoeHybridDecoderLayer
    final_norm_name = "norm"

    def __init__(
        self, config: ModelConfig, max_model_len: int = 0, impls: LayerImpls = REFERENCE
    ) -> None:
        super().__init__(config, max_model_len, impls)
        if config.num_experts:
            self.routed_experts = RoutedExpertsRecorder(
                len(config.moe_layers), config.num_experts_per_tok
            )
            blocks = [m for m in self.modules() if isinstance(m, GraniteMoe)]
            assert len(blocks) == len(config.moe_layers)
            for index, block in enumerate(blocks):
                block.recorder = self.routed_experts
                block.moe_index = index
