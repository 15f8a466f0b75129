"""The SSD scan over packed requests in chunks: the intra-chunk quadratic (attention-like)
form plus inter-chunk state passing (Mamba2 paper, sec. 6; mamba_ssm's ssd_combined), fused in
one kernel that walks a request's chunks in order.

One program owns one (request, head, BLOCK_P rows of head_dim) state tile S [BLOCK_P, d_state]
(fp32, in registers) for the whole span. A chunk is the next Q = CHUNK tokens, cut short at the
span's end and at the next boundary offset (so every boundary state is an exact chunk-end
state). For a chunk with a_t = dt_t * A, a_t^ = cumsum(a) (inclusive), all fp32:
  y_t  = sum_{s<=t} (C_t . B_s) exp(a_t^ - a_s^) dt_s x_s   (tl.dot of [Q,Q] by [Q,P])
       + exp(a_t^) C_t . S                                   (the state entering the chunk)
       + D x_t
  S   <- exp(a_Q^) S + sum_s exp(a_Q^ - a_s^) dt_s x_s (outer) B_s
dt, A, x, B, C as in scan_kernel.py (the sequential form, which this kernel equals up to fp32
reassociation). Unlike mamba_ssm, chunks of one request are not spread over programs: the
parallelism is requests x heads x head_dim tiles, each chunk step a few small matrix products.
DOT_PRECISION: "ieee" (fp32 models) or "tf32" (16-bit models) for the products on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.mamba.ssm_math import mask_if, softplus_clamped
from meshllm_kernels.runtime.tensor_checks import interpreting, next_power_of_2


@triton.jit
def _ssd_chunk_scan_kernel(
    xbc_ptr,
    dt_ptr,
    y_ptr,
    state_ptr,
    dt_bias_ptr,
    a_log_ptr,
    d_ptr,
    cu_ptr,
    read_ptr,
    write_ptr,
    scu_ptr,
    soff_ptr,
    sslot_ptr,
    dt_min,
    dt_max,
    head_dim,
    d_state,
    d_inner,
    group_stride,
    heads_per_group,
    stride_x,
    stride_dt,
    stride_y,
    stride_sb,
    stride_sh,
    HAS_BOUNDS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, CHUNK)
    pmask = offs_p < head_dim
    nmask = offs_n < d_state
    smask = pmask[:, None] & nmask[None, :]
    start = tl.load(cu_ptr + r)
    length = tl.load(cu_ptr + r + 1) - start
    g = h // heads_per_group
    A = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    D = tl.load(d_ptr + h).to(tl.float32)
    tile = h * stride_sh + offs_p[:, None] * d_state + offs_n[None, :]
    read = tl.load(read_ptr + r).to(tl.int64)
    S = tl.load(state_ptr + read * stride_sb + tile, mask=mask_if(smask, read >= 0), other=0.0)
    S = S.to(tl.float32)
    x_col = h * head_dim + offs_p
    b_col = d_inner + g * d_state + offs_n
    c_col = b_col + group_stride
    causal = offs_q[:, None] >= offs_q[None, :]
    b_next = 0
    b_end = 0
    off_next = -1
    if HAS_BOUNDS:
        b_next = tl.load(scu_ptr + r)
        b_end = tl.load(scu_ptr + r + 1)
        off_next = tl.load(soff_ptr + b_next, mask=b_next < b_end, other=-1)
    t0 = length * 0  # an int32 tensor, carried through the loop
    while t0 < length:
        t1 = tl.minimum(t0 + CHUNK, length)
        if HAS_BOUNDS:
            t1 = tl.where(off_next > t0, tl.minimum(t1, off_next), t1)
        qmask = offs_q < t1 - t0
        rows = (start + t0 + offs_q).to(tl.int64)
        x = tl.load(xbc_ptr + rows[:, None] * stride_x + x_col[None, :],
                    mask=qmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        B = tl.load(xbc_ptr + rows[:, None] * stride_x + b_col[None, :],
                    mask=qmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        C = tl.load(xbc_ptr + rows[:, None] * stride_x + c_col[None, :],
                    mask=qmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        dt = tl.load(dt_ptr + rows * stride_dt + h, mask=qmask, other=0.0).to(tl.float32)
        dt = tl.where(qmask, softplus_clamped(dt + dt_bias, dt_min, dt_max), 0.0)
        acum = tl.cumsum(dt * A, axis=0)  # flat past the chunk's end: those a_t are 0
        a_end = tl.sum(dt * A, axis=0)
        seg = tl.where(causal, acum[:, None] - acum[None, :], -float("inf"))
        G = tl.dot(C, tl.trans(B), input_precision=DOT_PRECISION)
        M = G * tl.exp(seg) * dt[None, :]
        y = tl.dot(M, x, input_precision=DOT_PRECISION)
        y += tl.dot(C, tl.trans(S), input_precision=DOT_PRECISION) * tl.exp(acum)[:, None]
        y += D * x
        tl.store(y_ptr + rows[:, None] * stride_y + x_col[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=qmask[:, None] & pmask[None, :])  # fmt: skip
        w = tl.exp(a_end - acum) * dt
        S = S * tl.exp(a_end) + tl.dot(tl.trans(x * w[:, None]), B, input_precision=DOT_PRECISION)
        if HAS_BOUNDS:  # noqa: SIM102 (a constexpr: the inner branch is not compiled without)
            if t1 == off_next:
                slot = tl.load(sslot_ptr + b_next).to(tl.int64)
                tl.store(state_ptr + slot * stride_sb + tile, S.to(state_ptr.dtype.element_ty),
                         mask=mask_if(smask, slot >= 0))  # fmt: skip
                b_next += 1
                off_next = tl.load(soff_ptr + b_next, mask=b_next < b_end, other=-1)
        t0 = t1
    write = tl.load(write_ptr + r).to(tl.int64)
    tl.store(state_ptr + write * stride_sb + tile, S.to(state_ptr.dtype.element_ty),
             mask=mask_if(smask, write >= 0))  # fmt: skip


def ssd_chunk_scan(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    p: object,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    out_dtype: torch.dtype,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Launch over checked inputs (`p` a MambaParams); xbc is the conv output [T, conv_dim].
    chunk_size: a power of two >= 16. Returns y [T, n_heads, head_dim]."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    T = xbc.shape[0]
    y = torch.empty(T, p.n_heads, p.head_dim, dtype=out_dtype, device=xbc.device)
    rows = read_slot.shape[0]
    if rows == 0:
        return y
    block_n = max(16, next_power_of_2(p.d_state))
    block_p = max(16, min(next_power_of_2(p.head_dim), 64))
    scu, soff, sslot = bounds if bounds is not None else (read_slot, read_slot, read_slot)
    fp32 = xbc.dtype == torch.float32 or interpreting()
    grid = (rows, p.n_heads, triton.cdiv(p.head_dim, block_p))
    _ssd_chunk_scan_kernel[grid](
        xbc, dt, y, ssm_state, p.dt_bias, p.A_log, p.D, cu_seqlens, read_slot, write_slot,
        scu, soff, sslot, float(p.dt_min), float(p.dt_max), p.head_dim, p.d_state, p.d_inner,
        p.n_groups * p.d_state, p.n_heads // p.n_groups, xbc.stride(0), dt.stride(0),
        y.stride(0), ssm_state.stride(0), ssm_state.stride(1),
        HAS_BOUNDS=bounds is not None, CHUNK=chunk_size, BLOCK_P=block_p, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if fp32 else "tf32", num_warps=4,
    )  # fmt: skip
    return y
