"""The worker's layers on CUDA: Triton RMSNorm(+residual), the decode GEMV, the gated MLP's
down projection with its SiLU fused into the GEMV, and one SiLU-and-multiply kernel for the
gated MLP's larger steps.

`TRITON` is the `LayerImpls` (models/layer_impls.py) a model is built with to run them: the
model families build their Linear, RMSNorm and GatedMLP from it, and get these subclasses of
the reference modules (same parameters, same state_dict names), plus the decode chain
(decode_chain.py) where the loaded model fits it. Each forward still falls back to PyTorch for
what the kernel does not take: CPU tensors, more than `gemv_max_rows()` rows (a GEMM's job:
cuBLAS), a dtype mismatch, a norm over a non-contiguous tensor, an activation other than SiLU.

Numerics: the RMSNorm kernel rounds exactly as transformers' Llama does (see
meshllm_kernels/layers/rmsnorm.py), the GEMV accumulates in fp32 and rounds once, so greedy tokens
of an fp32 model equal the CPU reference, and bf16 logits stay within bf16 rounding of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.layer_impls import LayerImpls
from services.worker.models.layers import GatedMLP, RMSNorm

if TYPE_CHECKING:
    from services.worker.accel.decode_chain import DecodeChain
    from services.worker.models.base import CausalLM

# meshllm_kernels.decode_chain.gemv's limits, restated so importing this module does not import
# Triton (the kernel modules bind to the compiler or the interpreter at import; see
# attention/select.py).
GEMV_KERNEL_MAX_ROWS = 128
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Steps of up to this many rows run the GEMV and the decode chain, larger ones cuBLAS: 16, the
# batches the GEMV's tiles were tuned for on the H200, unless the worker is told otherwise
# (settings.gemv_max_rows, `set_gemv_max_rows`; up to GEMV_KERNEL_MAX_ROWS).
GEMV_MAX_ROWS = 16
_gemv_max_rows = GEMV_MAX_ROWS


def gemv_max_rows() -> int:
    """The most rows a step may have for the GEMV and the decode chain to run it."""
    return _gemv_max_rows


def set_gemv_max_rows(rows: int) -> None:
    """Route steps of up to `rows` rows (1..GEMV_KERNEL_MAX_ROWS) to the GEMV and the decode
    chain; set before the CUDA graphs are captured (each graph keeps the path it captured)."""
    global _gemv_max_rows
    if not 1 <= rows <= GEMV_KERNEL_MAX_ROWS:
        raise ValueError(f"gemv_max_rows must be in 1..{GEMV_KERNEL_MAX_ROWS}, got {rows}")
    _gemv_max_rows = rows


class GemvLinear(nn.Linear):
    """nn.Linear whose skinny products (decode-sized steps: `gemv_max_rows`) run the Triton
    GEMV."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _gemv_rows(x, self.weight):
            from meshllm_kernels.decode_chain.gemv import gemv

            out = gemv(x.contiguous(), self.weight)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The GEMV takes x: on CUDA, [rows, K] with 1..gemv_max_rows() rows, weight's dtype."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= _gemv_max_rows
        and x.dtype == weight.dtype
        and x.dtype in GEMV_DTYPES
    )


class GemvGatedMLP(GatedMLP):
    """GatedMLP whose decode-sized steps run silu(gate) * up inside the down projection's
    GEMV (meshllm_kernels.decode_chain.gemv `gated=True`): two elementwise launches and an [rows,
    intermediate] round trip fewer per layer. Larger steps run it as one kernel
    (meshllm_kernels.layers.silu_mul) instead of eager's two. SiLU models only; other activations
    take the plain path."""

    def project(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        down = self.down_proj
        if self.act is F.silu and gate_up.is_contiguous() and _gemv_rows(gate_up, down.weight):
            from meshllm_kernels.decode_chain.gemv import gemv

            out = gemv(gate_up, down.weight, gated=True)
            return out if down.bias is None else out + down.bias
        if self.act is F.silu and _silu_mul_takes(gate_up):
            from meshllm_kernels.layers.silu_mul import silu_mul

            return down(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        out_: torch.Tensor = down(self.act(gate) * up)
        return out_


def _silu_mul_takes(gate_up: torch.Tensor) -> bool:
    """The SiLU-and-multiply kernel takes [T, 2D] on CUDA with a contiguous last dimension."""
    return (
        gate_up.is_cuda
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
        and gate_up.dtype in GEMV_DTYPES
    )


class TritonRMSNorm(RMSNorm):
    """RMSNorm with the fused residual add in one Triton launch per call on CUDA."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_cuda or not x.is_contiguous() or x.dtype != self.weight.dtype:
            return super().forward(x, residual)
        if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape):
            return super().forward(x, residual)
        from meshllm_kernels.layers.rmsnorm import rmsnorm

        rows = x.view(-1, x.shape[-1])
        res = residual.view(-1, x.shape[-1]) if residual is not None else None
        normed, summed = rmsnorm(rows, self.weight, self.eps, res)
        new_residual = summed.view(x.shape) if summed is not None else x
        return normed.view(x.shape), new_residual


def _decode_chain_for(model: CausalLM) -> DecodeChain | None:
    # Imported here: decode_chain.py builds on this module's classes.
    from services.worker.accel.decode_chain import decode_chain_for

    return decode_chain_for(model)


TRITON = LayerImpls(
    "triton",
    linear_cls=GemvLinear,
    norm_cls=TritonRMSNorm,
    gated_mlp_cls=GemvGatedMLP,
    decode_chain_for=_decode_chain_for,
)
