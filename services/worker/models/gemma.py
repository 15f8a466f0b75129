"""Gemma-3 text models (Gemma3ForCausalLM): interleaved sliding-window and full-attention layers.

Differences from Llama, all here: embeddings scaled by sqrt(hidden); RMSNorm with a (1 + w)
scale (`GemmaRMSNorm`), also for the per-head q/k norms; four norms per layer (the attention and
MLP outputs are normalised before the residual add); GeGLU MLP (tanh gelu); attention scale
query_pre_attn_scalar**-0.5; sliding layers rotate with their own RoPE base (`rope_local`).
Soft-capped logits (Gemma-2) are refused by ModelConfig.
"""

from __future__ import annotations

import torch

from services.worker.models.layer_impls import REFERENCE, LayerImpls
from services.worker.models.layers import GemmaRMSNorm
from services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from shared.model.config import ModelConfig


def gemma_impls(impls: LayerImpls) -> LayerImpls:
    """Gemma's (1 + w) norm has no kernel: every norm of the model (layers, q/k, final) is
    the reference GemmaRMSNorm on every device; the linears and the MLP are `impls`'."""
    return impls.with_norm(GemmaRMSNorm)


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(
        self, config: ModelConfig, layer_idx: int = 0, impls: LayerImpls = REFERENCE
    ) -> None:
        impls = gemma_impls(impls)
        super().__init__(config, layer_idx, impls)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = impls.rms_norm(size, eps)
        self.post_feedforward_layernorm = impls.rms_norm(size, eps)

    def mlp_input(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output is normalised on its own before the residual add."""
        out, _ = self.post_attention_layernorm(attn_out)
        return self.pre_feedforward_layernorm(out, residual)

    def mlp_output(self, out: torch.Tensor) -> torch.Tensor:
        """The MLP output is normalised too; Llama's (output, residual) contract is kept."""
        return self.post_feedforward_layernorm(out)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GemmaDecoderLayer

    def __init__(
        self, config: ModelConfig, max_model_len: int = 0, impls: LayerImpls = REFERENCE
    ) -> None:
        super().__init__(config, max_model_len, gemma_impls(impls))
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight
        # transformers rounds the scale to the embedding dtype before multiplying
        return self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=weight.dtype)
