"""The SSM recurrence over packed requests, sequential over time (decode: one step).

Per head h (group g = h // (n_heads // n_groups)), with x, B, C read from the conv output
xBC' `[T, conv_dim]` (`[x | B | C]` channels) and dt from `[T, n_heads]`:
  dt = clamp(softplus(dt + dt_bias), dt_min, dt_max), dA = exp(dt * A), A = -exp(A_log)
  S  = dA * S + (dt * x) (outer) B          S: [head_dim, d_state], fp32 in registers
  y  = sum_n S * C + D * x                  (from the fp32 S, rounded to y's dtype)
One program owns one (request, head, BLOCK_P rows of head_dim) tile of the state for the whole
span: it reads the initial tile from the read slot (zeros for -1), steps through the tokens,
stores the tile to a boundary slot when the step count reaches that boundary's offset, and to
the final write slot at the end (so in-place read == write is safe; a -1 slot stores nothing).
States are stored rounded to the pool's dtype; the running state stays fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.mamba.ssm_math import mask_if, softplus_clamped
from meshllm_kernels.runtime.tensor_checks import next_power_of_2


@triton.jit
def _ssm_scan_kernel(
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
    DECODE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    pmask = offs_p < head_dim
    nmask = offs_n < d_state
    smask = pmask[:, None] & nmask[None, :]
    if DECODE:
        start = r
        length = 1
    else:
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
    x_off = h * head_dim + offs_p
    b_off = d_inner + g * d_state + offs_n
    c_off = b_off + group_stride
    if HAS_BOUNDS:
        b_next = tl.load(scu_ptr + r)
        b_end = tl.load(scu_ptr + r + 1)
        off_next = tl.load(soff_ptr + b_next, mask=b_next < b_end, other=-1)
    for i in range(0, length):
        row = xbc_ptr + (start + i).to(tl.int64) * stride_x
        x = tl.load(row + x_off, mask=pmask, other=0.0).to(tl.float32)
        B = tl.load(row + b_off, mask=nmask, other=0.0).to(tl.float32)
        C = tl.load(row + c_off, mask=nmask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + (start + i).to(tl.int64) * stride_dt + h).to(tl.float32)
        dt = softplus_clamped(dt + dt_bias, dt_min, dt_max)
        S = S * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
        y = tl.sum(S * C[None, :], axis=1) + D * x
        dst = y_ptr + (start + i).to(tl.int64) * stride_y + x_off
        tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=pmask)
        if HAS_BOUNDS:  # noqa: SIM102 (a constexpr: the inner branch is not compiled without)
            if i + 1 == off_next:
                slot = tl.load(sslot_ptr + b_next).to(tl.int64)
                tl.store(state_ptr + slot * stride_sb + tile, S.to(state_ptr.dtype.element_ty),
                         mask=mask_if(smask, slot >= 0))  # fmt: skip
                b_next += 1
                off_next = tl.load(soff_ptr + b_next, mask=b_next < b_end, other=-1)
    write = tl.load(write_ptr + r).to(tl.int64)
    tl.store(state_ptr + write * stride_sb + tile, S.to(state_ptr.dtype.element_ty),
             mask=mask_if(smask, write >= 0))  # fmt: skip


def ssm_scan(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    p: object,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Launch over checked inputs (`p` a MambaParams). cu_seqlens None: decode, one token per
    row. xbc is the conv output [T, conv_dim]; returns y [T, n_heads, head_dim]."""
    T = xbc.shape[0]
    y = torch.empty(T, p.n_heads, p.head_dim, dtype=out_dtype, device=xbc.device)
    rows = read_slot.shape[0]
    if rows == 0:
        return y
    block_n = next_power_of_2(p.d_state)
    block_p = max(1, min(next_power_of_2(p.head_dim), 4096 // block_n))
    scu, soff, sslot = bounds if bounds is not None else (read_slot, read_slot, read_slot)
    grid = (rows, p.n_heads, triton.cdiv(p.head_dim, block_p))
    _ssm_scan_kernel[grid](
        xbc, dt, y, ssm_state, p.dt_bias, p.A_log, p.D,
        cu_seqlens if cu_seqlens is not None else read_slot, read_slot, write_slot,
        scu, soff, sslot, float(p.dt_min), float(p.dt_max), p.head_dim, p.d_state, p.d_inner,
        p.n_groups * p.d_state, p.n_heads // p.n_groups, xbc.stride(0), dt.stride(0),
        y.stride(0), ssm_state.stride(0), ssm_state.stride(1),
        HAS_BOUNDS=bounds is not None, DECODE=cu_seqlens is None,
        BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=4 if block_p * block_n >= 2048 else 2,
    )  # fmt: skip
    return y
