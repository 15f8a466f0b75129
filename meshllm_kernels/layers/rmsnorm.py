"""RMSNorm fused with the residual add, and its reference.

Rounding follows the transformers Llama layers, which the model runner is anchored on:
the residual sum is rounded to the activation dtype (HF adds in that dtype), the norm is
computed in fp32 from that rounded sum, cast back to the activation dtype, and only then
multiplied by the weight in the activation dtype:

    residual' = dtype(x + residual)
    normed    = dtype(weight * dtype(residual' * rsqrt(mean(residual'^2) + eps)))

Without a residual it is plain RMSNorm. One program normalizes one row (hidden <= 64k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.runtime.pdl import chain_handoff
from meshllm_kernels.runtime.tensor_checks import (
    MODEL_DTYPES,
    check_shape,
    check_tensor,
    next_power_of_2,
    pdl_launch,
    supports_pdl,
)

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    chain_handoff(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    add_rmsnorm_row(
        x, residual_ptr + row * stride_r, weight_ptr, out_ptr + row * stride_o,
        residual_out_ptr + row * stride_ro, offs, mask, eps, hidden, HAS_RESIDUAL,
    )  # fmt: skip


@triton.jit
def add_rmsnorm_row(
    x,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    offs,
    mask,
    eps,
    hidden,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row: x (fp32 holding activation-dtype values) plus the residual row, rounded and
    stored at residual_out_ptr; its RMSNorm times the weight stored at out_ptr (the rounding
    order of the module docstring). Shared with the GEMV's fused reduce
    (meshllm_kernels/decode_chain/gemv.py)."""
    dtype = out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(residual_out_ptr + offs, x, mask=mask)
        x = x.to(tl.float32)
    mean_sq = tl.sum(x * x, 0) / hidden
    normed = (x * tl.math.rsqrt(mean_sq + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (normed * w).to(dtype), mask=mask)


def norm_warps(block: int) -> int:
    """Warps of a one-row-per-program norm over `block` (a power of two) elements."""
    return min(16, max(1, block // 256))


def check_norm_inputs(
    x: torch.Tensor,
    rows_shape: tuple[int, ...],
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(residual, weight) checked against x's dtype and device and the rows' shape
    [T, hidden]."""
    hidden = rows_shape[-1]
    weight = check_tensor(
        "weight", weight, dtypes=(x.dtype,), ndim=1, device=x.device, contiguous=True
    )
    check_shape("weight", weight, (hidden,))
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if residual is None:
        return None, weight
    residual = check_tensor(
        "residual", residual, dtypes=(x.dtype,), ndim=2, device=x.device,
        last_dim_contiguous=True,
    )  # fmt: skip
    check_shape("residual", residual, rows_shape)
    return residual, weight


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalize rows of x [T, hidden]; returns (normed, x + residual or None). Launched in the
    decode step's PDL chain where the device supports it (meshllm_kernels/runtime/pdl.py)."""
    x = check_tensor("x", x, dtypes=MODEL_DTYPES, ndim=2, last_dim_contiguous=True)
    num_rows, hidden = x.shape
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in 1..{MAX_HIDDEN}, got {hidden}")
    residual, weight = check_norm_inputs(x, tuple(x.shape), weight, eps, residual)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out) if residual is not None else None
    if num_rows == 0:
        return out, residual_out
    block = next_power_of_2(hidden)
    use_pdl = supports_pdl(x.device)
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else out
    _rmsnorm_kernel[(num_rows,)](
        x, r, weight, out, ro, float(eps), hidden,
        x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=use_pdl,
        num_warps=norm_warps(block), **pdl_launch(use_pdl),
    )  # fmt: skip
    return out, residual_out


def rmsnorm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transformers' LlamaRMSNorm after a residual add, op for op."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual
