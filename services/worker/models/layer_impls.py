"""Which implementation a model's building blocks run, fixed when the model is built.

A model family builds every Linear, RMSNorm and gated MLP through the `LayerImpls` it is given
(`impls.linear(...)`, `impls.rms_norm(...)`, `impls.gated_mlp(...)`), so reading a family
says where the choice is made, and the choice itself is one object:

- `REFERENCE`: PyTorch modules (`nn.Linear`, layers.RMSNorm, layers.GatedMLP). CPU workers run
  these; on CPU the loader then lays bf16 linears out for oneDNN (packed_linear.py) or fp32
  weights column-major (loader.prepare_for_device), and `MESHLLM_CPU_COMPILE` compiles them.
- `TRITON` (services/worker/accel/cuda_layers.py): the same modules with the Triton RMSNorm and
  decode GEMV, and the decode chain (accel/decode_chain.py) on a model that fits it.

Tensor parallelism (services/worker/parallel) is one more field: `with_tp(tp)` gives the same
implementations for one rank of a group. The model is then built from the rank's config
(parallel/shard_config.py: its heads and intermediate sizes), so its Linears are already the
rank's column/row shards; what the impls add is the communication: `row_reduce` (the all-reduce
after a row-parallel projection: o_proj, down_proj), the vocab-parallel `embedding` and
`lm_head`, and `gather_logits`. At size 1 these are the plain modules and identities.

Every implementation keeps the reference's parameters and state_dict names (the kernel classes
subclass the reference ones), so the loaders and checkpoints do not depend on the choice. The
loader picks by device (loader.layer_impls_for); drafters and references pass their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.models.layers import GatedMLP, RMSNorm
from services.worker.parallel.group import SINGLE, TensorParallel
from services.worker.parallel.shard_config import vocab_rows_of_rank
from services.worker.parallel.vocab import VocabParallelEmbedding, gather_logits

if TYPE_CHECKING:
    from services.worker.accel.decode_chain import DecodeChain
    from services.worker.models.base import CausalLM


def no_decode_chain(model: CausalLM) -> DecodeChain | None:
    """Every step runs the layer-by-layer forward."""
    return None


@dataclass(frozen=True)
class LayerImpls:
    name: str
    linear_cls: type[nn.Linear] = nn.Linear
    norm_cls: type[RMSNorm] = RMSNorm
    gated_mlp_cls: type[GatedMLP] = GatedMLP
    # The model-level fused decode forward for a loaded model (its weights in place), or None.
    decode_chain_for: Callable[[CausalLM], DecodeChain | None] = no_decode_chain
    # The tensor-parallel group the model is one rank of (SINGLE: not sharded).
    tp: TensorParallel = SINGLE

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
        return self.linear_cls(in_features, out_features, bias=bias)

    def rms_norm(self, hidden_size: int, eps: float) -> RMSNorm:
        return self.norm_cls(hidden_size, eps)

    def gated_mlp(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        act: str = "silu",
        reduce: bool = True,
    ) -> GatedMLP:
        """The MLP with its two projections built by this object's linear. `reduce=False`:
        its output stays this rank's partial sum (a caller that adds it to another partial
        sum reduces once, as the MoE block does with its shared expert)."""
        return self.gated_mlp_cls(
            hidden_size,
            intermediate_size,
            bias=bias,
            act=act,
            linear_cls=self.linear_cls,
            tp=self.tp if reduce else SINGLE,
        )

    def row_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The output of a row-parallel projection: the sum of the ranks' partial products
        (each rank multiplied its slice of the input features; rank 0 alone holds the bias)."""
        return self.tp.all_reduce(partial)

    def embedding(self, vocab_size: int, hidden_size: int) -> nn.Embedding:
        if self.tp.size == 1:
            return nn.Embedding(vocab_size, hidden_size)
        return VocabParallelEmbedding(vocab_size, hidden_size, self.tp)

    def lm_head(self, hidden_size: int, vocab_size: int) -> nn.Linear:
        """An untied LM head: this rank's vocabulary rows (column-parallel)."""
        return self.linear(hidden_size, len(vocab_rows_of_rank(vocab_size, self.tp)))

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[R, vocab] on every rank from each rank's [R, its vocabulary rows]."""
        return gather_logits(logits, vocab_size, self.tp)

    def with_norm(self, norm_cls: type[RMSNorm]) -> LayerImpls:
        """These implementations with a family's own norm (one that has no kernel)."""
        return replace(self, norm_cls=norm_cls)

    def with_tp(self, tp: TensorParallel) -> LayerImpls:
        """These implementations for one rank of `tp`. The decode chain reads whole weights
        and has no collectives, so a sharded model runs layer by layer (its all-reduces are
        captured in the CUDA graphs instead, accel/cuda_graphs.py)."""
        if tp.size == 1:
            return self
        return replace(self, tp=tp, decode_chain_for=no_decode_chain)


REFERENCE = LayerImpls("reference")
