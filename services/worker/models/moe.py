"""Sparse mixture-of-experts decoder models: Mixtral, Qwen2-MoE, Qwen3-MoE.

One `SparseMoeBlock` serves the three families; what differs is configuration:

- routing: softmax over all router logits (fp32), top-k, then renormalise the k probabilities
  to sum to 1 when `norm_topk_prob` (Mixtral always; Qwen-MoE per its config). Mixtral's
  "softmax over the top-k logits" is the same number.
- shared expert (Qwen2-MoE): a dense gated MLP added to every token, scaled by
  sigmoid(shared_expert_gate(x)).
- which layers are sparse: `ModelConfig.moe_layers` (Qwen's decoder_sparse_step/mlp_only_layers).
- attention: the Llama attention with the family's switches (Qwen2-MoE q/k/v biases, Qwen3-MoE
  q/k norms, Mixtral sliding windows).

The expert weights are stacked: `experts.gate_up_proj` [E, 2I, H] (rows [gate; up]) and
`experts.down_proj` [E, H, I], the layout transformers 5 uses in memory; the loader stacks
per-expert checkpoint tensors into it. The PyTorch path groups tokens by expert (one matmul per
expert that received tokens, no per-token loop); on CUDA the Triton fused-MoE kernel runs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.layer_impls import REFERENCE, LayerImpls
from services.worker.models.layers import ACTIVATIONS, GatedMLP
from services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from services.worker.runner.routed_experts import RoutedExpertsRecorder
from shared.model.config import ModelConfig


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) from router logits [T, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_grouped(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t, grouped by expert.

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights, ids [T, k]. The (token, slot) pairs
    are sorted by expert so each expert's tokens are one contiguous slice and one matmul.
    """
    top_k = ids.shape[1]
    inter = down.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x.index_select(0, token_of)
    ys = torch.empty_like(xs)
    activation = ACTIVATIONS[act]
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        gate, up = F.linear(xs[start:end], gate_up[expert]).split(inter, dim=-1)
        ys[start:end] = F.linear(activation(gate) * up, down[expert])
        start = end
    ys = ys * weights.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, ys)


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class SparseMoeBlock(nn.Module):
    """The router and the shared expert are `impls`' layers; the routed experts run the
    grouped PyTorch path on CPU and the fused-MoE kernel on CUDA (by the input's device)."""

    def __init__(self, config: ModelConfig, impls: LayerImpls = REFERENCE) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.act = config.hidden_act
        self.gate = impls.linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = StackedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = impls.gated_mlp(
                config.hidden_size,
                config.shared_expert_intermediate_size,
                act=config.hidden_act,
                reduce=False,  # summed with the routed experts' partial output, reduced once
            )
            self.shared_expert_gate = impls.linear(config.hidden_size, 1, bias=False)
        # Set by the model: where this block's routed ids go, and its index among MoE layers.
        self.recorder: RoutedExpertsRecorder | None = None
        self.moe_index = 0
        # Under tensor parallelism every rank holds a slice of every expert's intermediate
        # dimension (parallel/shard_config.py): the router is replicated, so routing is the
        # same on every rank, and the block's partial outputs are summed once at its end.
        self.row_reduce = impls.row_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.recorder is not None:
            self.recorder.record(self.moe_index, ids)
        if x.is_cuda:
            from meshllm_kernels.layers.fused_moe import fused_moe

            out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        else:
            out = experts_grouped(
                x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.act
            )
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.row_reduce(out)


class MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: ModelConfig, layer_idx: int, impls: LayerImpls) -> nn.Module:
        if layer_idx in config.moe_layers:
            return SparseMoeBlock(config, impls)
        return super().build_mlp(config, layer_idx, impls)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE. `routed_experts` records each MoE layer's top-k ids
    during a forward when the runner starts it (see services/worker/runner/routed_experts.py)."""

    decoder_layer_cls = MoeDecoderLayer

    def __init__(
        self, config: ModelConfig, max_model_len: int = 0, impls: LayerImpls = REFERENCE
    ) -> None:
        super().__init__(config, max_model_len, impls)
        self.routed_experts = RoutedExpertsRecorder(
            len(config.moe_layers), config.num_experts_per_tok
        )
        blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
        for index, block in enumerate(blocks):
            block.recorder = self.routed_experts
            block.moe_index = index
