"""Elementwise maths shared by the Mamba2 kernels (fp32 in, fp32 out)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def softplus_clamped(x, dt_min, dt_max):
    """clamp(softplus(x), dt_min, dt_max) with torch's threshold (x > 20: x). log1p(u) is
    computed as log(v) * u / (v - 1), v = 1 + u (exact to a few ulp without a log1p), so small
    softplus values keep their relative precision."""
    u = tl.exp(tl.minimum(x, 20.0))
    v = 1.0 + u
    log1p_u = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
    sp = tl.where(x > 20.0, x, log1p_u)
    return tl.minimum(tl.maximum(sp, dt_min), dt_max)


@triton.jit
def mask_if(mask, cond):
    """mask & cond for a scalar cond (Triton's interpreter turns `tensor & scalar` into int32,
    which tl.load rejects as a mask)."""
    return tl.where(cond, mask, False)
