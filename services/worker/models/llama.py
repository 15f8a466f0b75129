"""Llama (and SmolLM2, and other Llama-shaped checkpoints): grouped-query attention over the
paged KV cache, SwiGLU MLP, tied or untied embeddings.

The model runs over a FLAT batch of tokens from many requests: `forward(input_ids[T],
positions[T], attn, kv_caches) -> hidden[T, H]`; `compute_logits` then projects only the rows
that are sampled, so a 2,000-token prefill chunk never builds a [2000, vocab] logits tensor.

Parameter names are ours (q/k/v fused into `qkv_proj`, gate/up into `gate_up_proj`); the loaders
map checkpoint names onto them.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.attention import AttentionMetadata, paged_attention
from services.worker.models.base import CausalLM
from services.worker.models.config import ModelConfig
from services.worker.models.layers import GatedMLP, RMSNorm
from services.worker.models.rope import RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias
        )  # rows [q; k; v]
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # Rotate q and k together: one elementwise pass over [T, heads + kv_heads, d].
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, -1, self.head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, attn, self.scale)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        input norm adds them, so the residual add is fused into the norm call."""
        normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, attn, kv_cache)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_model_len: int = 0) -> None:
        super().__init__()
        self.config = config
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope, self.max_model_len, config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, attn, kv_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] of the sampled rows -> logits [R, vocab].

        With tied embeddings `lm_head` is None and the embedding matrix is the projection,
        unless the loader installed a separately laid-out head (see packed_linear.py)."""
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        logits: torch.Tensor = self.lm_head(hidden)
        return logits
