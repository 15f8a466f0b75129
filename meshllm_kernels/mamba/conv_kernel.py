"""Causal depthwise conv1d + SiLU over packed requests, continuing from each request's conv
state, and the conv states it leaves at the requested offsets.

Conv state slot layout `[conv_dim, d_conv - 1]`: the last d_conv - 1 inputs, oldest first.
Input position i of a request (0-based within its span) reads xBC; a negative position -j reads
column d_conv - 1 - j of the request's read slot (zeros when the slot is -1). Output:
  out_t = dtype(SiLU(bias + sum_k w[:, k] * in_{t - d_conv + 1 + k}))   (fp32 sums, left to right)
The state after o tokens is the inputs o - d_conv + 1 .. o - 1.

Prefill: TILE_PROGRAMS programs per (request, block of BLOCK_C channels) share the span's
token tiles, reading the initial state; a second launch then writes the boundary states and
the final state, one program per (request, channel block), each window loaded before it is
stored, so a final write slot equal to the read slot (in-place) is safe. Decode: one program
per (row, channel block) does both. Boundary slots must differ from every read slot of the
launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.mamba.ssm_math import mask_if, silu
from meshllm_kernels.runtime.tensor_checks import interpreting, next_power_of_2


@triton.jit
def _window(
    xbc_ptr,
    state_ptr,
    start,
    read,
    pos,
    offs_c,
    cmask,
    stride_x,
    stride_sb,
    K1: tl.constexpr,
):
    """Conv inputs at positions `pos` (any shape broadcast against offs_c's last axis): xBC
    rows for pos >= 0, the read slot's columns for pos < 0, fp32."""
    from_x = pos >= 0
    xv = tl.load(
        xbc_ptr + (start + tl.maximum(pos, 0)).to(tl.int64) * stride_x + offs_c,
        mask=cmask & from_x, other=0.0,
    )  # fmt: skip
    sv = tl.load(
        state_ptr + read.to(tl.int64) * stride_sb + offs_c * K1 + tl.maximum(K1 + pos, 0),
        mask=mask_if(cmask & (pos < 0), read >= 0), other=0.0,
    )  # fmt: skip
    return tl.where(from_x, xv.to(tl.float32), sv.to(tl.float32))


@triton.jit
def _store_state(
    xbc_ptr,
    state_ptr,
    start,
    read,
    offset,
    slot,
    offs_c,
    cmask,
    stride_x,
    stride_sb,
    K1: tl.constexpr,
    KPAD: tl.constexpr,
):
    """Write the conv state after `offset` tokens (inputs offset - K1 .. offset - 1) to slot."""
    j = tl.arange(0, KPAD)[None, :]
    c = offs_c[:, None]
    m = cmask[:, None] & (j < K1)
    win = _window(xbc_ptr, state_ptr, start, read, offset - K1 + j, c, m, stride_x, stride_sb, K1)
    dst = state_ptr + slot.to(tl.int64) * stride_sb + c * K1 + j
    tl.store(dst, win.to(state_ptr.dtype.element_ty), mask=mask_if(m, slot >= 0))


@triton.jit
def _span(cu_ptr, r, DECODE: tl.constexpr):
    """(first row, length) of request r's span: row r, 1 token when decoding."""
    if DECODE:
        start = r
        length = 1
    else:
        start = tl.load(cu_ptr + r)
        length = tl.load(cu_ptr + r + 1) - start
    return start, length


@triton.jit
def _write_states(
    xbc_ptr, state_ptr, start, length, read, r, write_ptr, scu_ptr, soff_ptr, sslot_ptr, offs_c,
    cmask, stride_x, stride_sb, K1: tl.constexpr, KPAD: tl.constexpr, HAS_BOUNDS: tl.constexpr,
):  # fmt: skip
    """Request r's boundary conv states, then its final one (which may overwrite its read
    slot: each window is loaded before it is stored)."""
    if HAS_BOUNDS:
        for i in range(tl.load(scu_ptr + r), tl.load(scu_ptr + r + 1)):
            _store_state(
                xbc_ptr, state_ptr, start, read, tl.load(soff_ptr + i),
                tl.load(sslot_ptr + i).to(tl.int64), offs_c, cmask, stride_x, stride_sb, K1, KPAD,
            )  # fmt: skip
    _store_state(
        xbc_ptr, state_ptr, start, read, length, tl.load(write_ptr + r).to(tl.int64), offs_c,
        cmask, stride_x, stride_sb, K1, KPAD,
    )  # fmt: skip


@triton.jit
def _causal_conv_kernel(
    xbc_ptr,
    out_ptr,
    state_ptr,
    weight_ptr,
    bias_ptr,
    cu_ptr,
    read_ptr,
    write_ptr,
    scu_ptr,
    soff_ptr,
    sslot_ptr,
    conv_dim,
    stride_x,
    stride_o,
    stride_sb,
    K: tl.constexpr,
    KPAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    DECODE: tl.constexpr,
    WRITE_STATES: tl.constexpr,
    TILE_PROGRAMS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid (requests, channel blocks, TILE_PROGRAMS): program j of a request computes its
    token tiles j, j + TILE_PROGRAMS, ... With WRITE_STATES (TILE_PROGRAMS = 1 only) it then
    writes the request's states; otherwise _conv_states_kernel does, launched after."""
    r = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = offs_c < conv_dim
    start, length = _span(cu_ptr, r, DECODE)
    read = tl.load(read_ptr + r).to(tl.int64)
    K1: tl.constexpr = K - 1
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=cmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    for t0 in range(tl.program_id(2) * BLOCK_T, length, TILE_PROGRAMS * BLOCK_T):
        t = t0 + offs_t
        tmask = t < length
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(K):
            w = tl.load(weight_ptr + offs_c * K + k, mask=cmask, other=0.0).to(tl.float32)
            v = _window(
                xbc_ptr, state_ptr, start, read, (t - K1 + k)[:, None], offs_c[None, :],
                cmask[None, :] & tmask[:, None], stride_x, stride_sb, K1,
            )  # fmt: skip
            acc += v * w[None, :]
        dst = out_ptr + (start + t).to(tl.int64)[:, None] * stride_o + offs_c[None, :]
        tl.store(dst, silu(acc).to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])
    if WRITE_STATES:
        _write_states(
            xbc_ptr, state_ptr, start, length, read, r, write_ptr, scu_ptr, soff_ptr, sslot_ptr,
            offs_c, cmask, stride_x, stride_sb, K1, KPAD, HAS_BOUNDS,
        )  # fmt: skip


@triton.jit
def _conv_states_kernel(
    xbc_ptr,
    state_ptr,
    cu_ptr,
    read_ptr,
    write_ptr,
    scu_ptr,
    soff_ptr,
    sslot_ptr,
    conv_dim,
    stride_x,
    stride_sb,
    K1: tl.constexpr,
    KPAD: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid (requests, channel blocks): the states of a prefill whose outputs were computed by
    several tile programs (launched after them, so none of them reads a rewritten slot)."""
    r = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start, length = _span(cu_ptr, r, False)
    _write_states(
        xbc_ptr, state_ptr, start, length, tl.load(read_ptr + r).to(tl.int64), r, write_ptr,
        scu_ptr, soff_ptr, sslot_ptr, offs_c, offs_c < conv_dim, stride_x, stride_sb, K1, KPAD,
        HAS_BOUNDS,
    )  # fmt: skip


def causal_conv(
    xBC: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Launch over checked inputs (see the launchers in decode_step / prefill). cu_seqlens
    None: decode, one token per row. Returns SiLU(conv) [T, conv_dim] in xBC's dtype."""
    conv_dim = xBC.shape[1]
    K = conv_weight.shape[1]
    out = torch.empty_like(xBC, memory_format=torch.contiguous_format)
    rows = read_slot.shape[0]
    if rows == 0:
        return out
    block_c = min(128, next_power_of_2(conv_dim))
    scu, soff, sslot = bounds if bounds is not None else (read_slot, read_slot, read_slot)
    decode = cu_seqlens is None
    cu = read_slot if decode else cu_seqlens
    tiles = 1 if decode else tile_programs()
    grid = (rows, triton.cdiv(conv_dim, block_c), tiles)
    _causal_conv_kernel[grid](
        xBC, out, conv_state, conv_weight,
        conv_bias if conv_bias is not None else conv_weight, cu, read_slot, write_slot,
        scu, soff, sslot, conv_dim, xBC.stride(0), out.stride(0), conv_state.stride(0),
        K=K, KPAD=next_power_of_2(K), HAS_BIAS=conv_bias is not None,
        HAS_BOUNDS=bounds is not None, DECODE=decode, WRITE_STATES=tiles == 1,
        TILE_PROGRAMS=tiles, BLOCK_T=1 if decode else 16, BLOCK_C=block_c,
    )  # fmt: skip
    if tiles > 1:
        _conv_states_kernel[grid[:2]](
            xBC, conv_state, cu, read_slot, write_slot, scu, soff, sslot, conv_dim,
            xBC.stride(0), conv_state.stride(0), K1=K - 1, KPAD=next_power_of_2(K),
            HAS_BOUNDS=bounds is not None, BLOCK_C=block_c,
        )  # fmt: skip
    return out


def tile_programs() -> int:
    """Programs per (request, channel block) sharing a prefill's token tiles: 2 under the
    interpreter (so tests cover the split), 16 on a GPU."""
    return 2 if interpreting() else 16
