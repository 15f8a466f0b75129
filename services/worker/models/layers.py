"""Building blocks shared by the decoder families: RMSNorm (Llama and Gemma flavours) with a
fused residual, gated MLP (SwiGLU, GeGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, exactly as transformers' Llama
    does it (the order matters for bf16 parity). For fp32 inputs the fused `F.rms_norm` kernel
    gives bit-identical results in one op instead of six, so it is used there.

    With `residual`, first adds it (x + residual becomes the new residual stream) and returns
    (normed, new_residual): one call per sub-layer instead of separate add and norm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the stored weight is an offset from 1 (scale = 1 + weight), and the
    product is taken in fp32 before casting back (Gemma's order, unlike Llama's)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * scale).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: gated-MLP activations by their HF name (ModelConfig.hidden_act checks against the same names)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (`gate_up_proj`,
    rows [gate; up]); the loader concatenates the checkpoint's two weights. `linear_cls` builds
    the two projections (layer_impls.py: the reference or a kernel's nn.Linear)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        act: str = "silu",
        linear_cls: type[nn.Linear] = nn.Linear,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = linear_cls(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = linear_cls(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
