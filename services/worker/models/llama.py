"""Llama (and SmolLM2, and other Llama-shaped checkpoints): grouped-query attention over the
paged KV cache, SwiGLU MLP, tied or untied embeddings.

The model runs over a FLAT batch of tokens from many requests: `forward(input_ids[T],
positions[T], attn, kv_caches) -> hidden[T, H]`; `compute_logits` then projects only the rows
that are sampled, so a 2,000-token prefill chunk never builds a [2000, vocab] logits tensor.

Parameter names are ours (q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`); the loaders
map checkpoint names onto them.

The other dense families are this model with config switches (Qwen2: q/k/v biases; Qwen3: q/k
norms; Mistral: sliding windows, which live in the per-layer attention metadata), and the MoE
families swap the MLP through `LlamaDecoderLayer.build_mlp`; Gemma overrides the norms and the
layer's residual wiring. So the attention and the decoder loop are written once, here.

What runs is chosen when the model is built: every Linear, RMSNorm and gated MLP comes from the
`LayerImpls` passed in (layer_impls.py: the PyTorch reference, or the Triton layers on CUDA),
and `forward` hands decode-sized steps to `decode_chain` where the loader set one
(services/worker/accel/decode_chain.py); otherwise it runs the layers one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata, rotary_attention
from services.worker.models.base import CausalLM, per_layer_metadata
from services.worker.models.layer_impls import REFERENCE, LayerImpls
from services.worker.models.layers import RMSNorm
from services.worker.models.rope import RotaryEmbedding
from shared.model.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, impls: LayerImpls = REFERENCE) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.qkv_proj = impls.linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.attention_bias or config.qkv_bias,
        )  # rows [q; k; v]
        self.o_proj = impls.linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = impls.rms_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = impls.rms_norm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        return self.o_proj(self.attend(hidden, cos, sin, attn, kv_cache))  # type: ignore[no-any-return]

    def attend(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Everything before the output projection: [T, heads * head_dim]."""
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_qk(qkv)
        return rotary_attention(
            qkv, cos, sin, attn, kv_cache,
            self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
        )  # fmt: skip

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each q and k head RMS-normalised (before RoPE, as Qwen3/Gemma3 do)."""
        assert self.q_norm is not None and self.k_norm is not None
        tokens = qkv.shape[0]
        q = qkv[:, : self.q_size].reshape(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :]
        q, k = self.q_norm(q)[0].flatten(1), self.k_norm(k)[0].flatten(1)
        return torch.cat((q, k, v), dim=1)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int = 0, impls: LayerImpls = REFERENCE
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = LlamaAttention(config, impls)
        self.mlp = self.build_mlp(config, layer_idx, impls)
        self.input_layernorm = impls.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = impls.rms_norm(config.hidden_size, config.rms_norm_eps)

    def build_mlp(self, config: ModelConfig, layer_idx: int, impls: LayerImpls) -> nn.Module:
        """The layer's MLP; MoE families return a sparse block for their sparse layers."""
        return impls.gated_mlp(
            config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act
        )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in, (mlp output, residual stream before it) out; the next layer's
        input norm adds them, so the residual add is fused into the norm call. The wiring
        between attention and MLP is `mlp_input`/`mlp_output`, which Gemma overrides."""
        normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, attn, kv_cache)
        normed, residual = self.mlp_input(hidden, residual)
        return self.mlp_output(self.mlp(normed)), residual

    def mlp_input(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's normed input, the residual stream with the attention output added)."""
        return self.post_attention_layernorm(attn_out, residual)

    def mlp_output(self, out: torch.Tensor) -> torch.Tensor:
        """The MLP output as the next layer receives it (Llama: unchanged)."""
        return out


class LlamaForCausalLM(CausalLM):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self, config: ModelConfig, max_model_len: int = 0, impls: LayerImpls = REFERENCE
    ) -> None:
        super().__init__()
        self.config = config
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i, impls) for i in range(config.num_hidden_layers)
        )
        self.norm = impls.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else impls.linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Set by the loader once the weights are in place (impls.decode_chain_for).
        self.decode_chain = None
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope, self.max_model_len, config.max_position_embeddings
        )
        # Sliding layers of some families (Gemma3) rotate with their own base frequency.
        self.rotary_local: RotaryEmbedding | None = None
        if config.rope_local is not None and "sliding_attention" in config.layer_types:
            self.rotary_local = RotaryEmbedding(
                config.head_dim,
                config.rope_local,
                self.max_model_len,
                config.max_position_embeddings,
            )
        self._local_layers = frozenset(
            i for i, t in enumerate(config.layer_types) if t == "sliding_attention"
        )
        # EAGLE-3 drafting (services/worker/spec/eagle3.py) reads the residual stream entering
        # these layers; empty = forward returns the final hidden state alone.
        self.aux_hidden_layers: tuple[int, ...] = ()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | Sequence[AttentionMetadata],
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        if self.decode_chain is not None and self.decode_chain.takes(input_ids):
            return self.decode_chain.forward(input_ids, positions, attn, kv_caches)
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        layer_inputs = self.layer_inputs(positions, attn, kv_caches)
        aux: dict[int, torch.Tensor] = {}
        for i, (layer, (cos, sin, meta, kv_cache)) in enumerate(
            zip(self.layers, layer_inputs, strict=True)
        ):
            if i in self.aux_hidden_layers:
                aux[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, cos, sin, meta, kv_cache)
        hidden, _ = self.norm(hidden, residual)
        if self.aux_hidden_layers:  # one tensor, so CUDA graphs capture it as any output
            return torch.cat([hidden, *(aux[i] for i in self.aux_hidden_layers)], dim=-1)
        return hidden

    def layer_inputs(
        self,
        positions: torch.Tensor,
        attn: AttentionMetadata | Sequence[AttentionMetadata],
        kv_caches: list[torch.Tensor],
    ) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]]:
        """Per layer: the RoPE cos/sin of its kind (sliding layers may have their own), its
        attention metadata and its KV cache."""
        cos, sin = self.rotary.lookup(positions)
        cos_local, sin_local = (
            self.rotary_local.lookup(positions) if self.rotary_local is not None else (cos, sin)
        )
        metas = per_layer_metadata(attn, len(self.layers))
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        return [
            (cos_local, sin_local, metas[i], kv_caches[i])
            if i in self._local_layers
            else (cos, sin, metas[i], kv_caches[i])
            for i in range(len(self.layers))
        ]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] of the sampled rows -> logits [R, vocab].

        With tied embeddings `lm_head` is None and the embedding matrix is the projection,
        unless the loader installed a separately laid-out head (see packed_linear.py)."""
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
