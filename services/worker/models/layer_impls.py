"""Which implementation a model's building blocks run, fixed when the model is built.

A model family builds every Linear, RMSNorm and gated MLP through the `LayerImpls` it is given
(`impls.linear(...)`, `impls.rms_norm(...)`, `impls.gated_mlp(...)`), so reading a family
says where the choice is made, and the choice itself is one object:

- `REFERENCE`: PyTorch modules (`nn.Linear`, layers.RMSNorm, layers.GatedMLP). CPU workers run
  these; on CPU the loader then lays bf16 linears out for oneDNN (packed_linear.py) or fp32
  weights column-major (loader.prepare_for_device), and `MESHLLM_CPU_COMPILE` compiles them.
- `TRITON` (services/worker/accel/cuda_layers.py): the same modules with the Triton RMSNorm and
  decode GEMV, and the decode chain (accel/decode_chain.py) on a model that fits it.

Every implementation keeps the reference's parameters and state_dict names (the kernel classes
subclass the reference ones), so the loaders and checkpoints do not depend on the choice. The
loader picks by device (loader.layer_impls_for); drafters and references pass their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import nn

from services.worker.models.layers import GatedMLP, RMSNorm

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

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
        return self.linear_cls(in_features, out_features, bias=bias)

    def rms_norm(self, hidden_size: int, eps: float) -> RMSNorm:
        return self.norm_cls(hidden_size, eps)

    def gated_mlp(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ) -> GatedMLP:
        """The MLP with its two projections built by this object's linear."""
        return self.gated_mlp_cls(
            hidden_size, intermediate_size, bias=bias, act=act, linear_cls=self.linear_cls
        )

    def with_norm(self, norm_cls: type[RMSNorm]) -> LayerImpls:
        """These implementations with a family's own norm (one that has no kernel)."""
        return replace(self, norm_cls=norm_cls)


REFERENCE = LayerImpls("reference")
