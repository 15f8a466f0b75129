"""SiLU-and-multiply of a gated MLP, `F.silu(gate) * up` over x = [gate | up], and its reference.

Eager PyTorch runs it as two launches over the strided halves of the gate_up projection: the
SiLU reads gate and writes [T, D], the multiply reads that and up and writes [T, D] again. One
kernel reads each input once and writes once: the intermediate's round trip is what the eager
pair costs, a part of every large decode batch's and prefill step's time.

Rounding is eager's, step by step: silu in fp32 as PyTorch's CUDA kernel computes it,
x / (1 + exp(-x)) with an IEEE division and the accurate expf (libdevice), rounded to the
activation dtype; then the product of the two rounded values, rounded once. On a GPU the
result is bit-identical to `F.silu(gate) * up`. Triton's CPU interpreter has no libdevice and
uses numpy's exp, which can differ in the last fp32 place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from meshllm_kernels.runtime.tensor_checks import MODEL_DTYPES, check_tensor, interpreting

BLOCK = 1024
MAX_COLUMN_BLOCKS = 65535  # the grid's second axis


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    D,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate_ptrs = x_ptr + row * stride_x + offs
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + D, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    act = tl.math.div_rn(g, 1.0 + e)
    act = act.to(gate.dtype, fp_downcast_rounding="rtne").to(tl.float32)
    out = (act * up).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2D] = [gate | up] (last dim contiguous); returns silu(gate) * up, [T, D] in x's
    dtype, rounded as eager rounds (module docstring)."""
    x = check_tensor("x", x, dtypes=MODEL_DTYPES, ndim=2, last_dim_contiguous=True)
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"silu_mul runs on CUDA (or TRITON_INTERPRET=1), x is on {x.device}")
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"x must be [gate | up], an even width; got {width}")
    d = width // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows == 0 or d == 0:
        return out
    blocks = triton.cdiv(d, BLOCK)
    if blocks > MAX_COLUMN_BLOCKS:
        raise ValueError(f"width {d} is more than {MAX_COLUMN_BLOCKS * BLOCK} columns")
    _silu_mul_kernel[(rows, blocks)](
        x, out, d, x.stride(0), out.stride(0), BLOCK=BLOCK, LIBDEVICE=not interpreting()
    )
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Eager PyTorch: F.silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
