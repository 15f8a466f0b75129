"""A persistent TMA GEMM, `x @ w.T`, and its gated form `silu(x @ wg.T) * (x @ wu.T)` (Hopper).

The gated form is a SiLU MLP's gate_up projection with the SiLU-and-multiply in its epilogue:
each output tile [BLOCK_M, BLOCK_N] holds two fp32 accumulators, one over the gate rows of the
weight (w[:D]) and one over the same columns' up rows (w[D:]), and stores silu(gate) * up. The
[T, 2D] gate_up activation never reaches memory: it is written once and read once by the
separate SiLU-and-multiply kernel (meshllm_kernels/layers/silu_mul.py) otherwise.

Loads and stores go through tensor descriptors (TMA), which zero-fill rows past M on load and
clip them on store. Programs walk output tiles pid, pid + grid, ... (grid: one program per SM at
most) in GROUP_M-row bands so that a band's weight tiles are read from L2 by its neighbours.

Rounding follows eager PyTorch, step by step: the fp32 accumulators round to the activation
dtype (what cuBLAS writes), silu of the rounded gate is computed in fp32 as
meshllm_kernels/layers/silu_mul.py does and rounded, and the product of the rounded values is
rounded once. Against cuBLAS + silu_mul only the order of the fp32 sums over K differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from meshllm_kernels.decode_chain.gemv import _split_k_reduce_kernel
from meshllm_kernels.runtime.tensor_checks import check_tensor, interpreting, sm_count

GEMM_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 4
    num_warps: int = 8
    warp_specialize: bool = False
    split_k: int = 1  # programs per output tile, each over a K range (fp32 partials, reduced)

    def __str__(self) -> str:
        ws = " ws" if self.warp_specialize else ""
        split = f" k{self.split_k}" if self.split_k > 1 else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} "
            f"s{self.num_stages} w{self.num_warps}{ws}{split}"
        )


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    band = GROUP_M * num_pid_n
    first_m = (tile // band) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % band) % rows
    pid_n = (tile % band) // rows
    return pid_m, pid_n


@triton.jit
def _silu_mul_rounded(acc_gate, acc_up, dtype: tl.constexpr, LIBDEVICE: tl.constexpr):
    g = acc_gate.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    up = acc_up.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    act = tl.math.div_rn(g, 1.0 + e).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    return (act * up).to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _gemm_kernel(
    a_desc,
    w_desc,
    up_desc,
    c_desc,
    part_desc,
    M,
    N,
    K,
    GRID,
    SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATED: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    USE_PARTIALS: tl.constexpr,
):
    dtype: tl.constexpr = c_desc.dtype
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_per_split = tl.cdiv(k_tiles, SPLIT)
    units = num_pid_m * num_pid_n * SPLIT
    for unit in tl.range(
        tl.program_id(0), units, GRID, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        split = unit % SPLIT
        pid_m, pid_n = _tile_coords(unit // SPLIT, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_first = split * k_per_split
        for ki in range(k_first, tl.minimum(k_first + k_per_split, k_tiles)):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            acc = tl.dot(a, w_desc.load([off_n, off_k]).T, acc)
            if GATED:
                acc_up = tl.dot(a, up_desc.load([off_n, off_k]).T, acc_up)
        if USE_PARTIALS:
            part_desc.store([split, off_m, off_n], acc.reshape(1, BLOCK_M, BLOCK_N))
        else:
            out = _silu_mul_rounded(acc, acc_up, dtype, LIBDEVICE) if GATED else acc.to(dtype)
            c_desc.store([off_m, off_n], out)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    check_tensor("x", x, dtypes=GEMM_DTYPES, ndim=2)
    check_tensor("w", w, dtypes=GEMM_DTYPES, ndim=2)
    if not x.is_contiguous() or not w.is_contiguous():
        raise ValueError("x and w must be contiguous")
    if x.dtype != w.dtype or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} differ")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"the TMA GEMM runs on CUDA (or TRITON_INTERPRET=1), x is on {x.device}")
    if (x.shape[1] * x.element_size()) % 16:
        raise ValueError("K * element size must be a multiple of 16 bytes (TMA)")


def gemm(
    x: torch.Tensor, w: torch.Tensor, config: GemmConfig, *, gated: bool = False
) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N]; gated: w = [gate; up] of [2D, K], returns
    silu(x @ gate.T) * (x @ up.T), [M, D], rounded as eager rounds (module docstring)."""
    _check(x, w)
    m, k = x.shape
    n = w.shape[0]
    if gated:
        if n % 2:
            raise ValueError(f"a gated w is [gate; up], an even row count; got {n}")
        n //= 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if (n * out.element_size()) % 16:
        raise ValueError("N * element size must be a multiple of 16 bytes (TMA)")
    if m == 0 or n == 0:
        return out
    c = config
    a_desc = TensorDescriptor.from_tensor(x, [c.block_m, c.block_k])
    w_desc = TensorDescriptor.from_tensor(w[:n], [c.block_n, c.block_k])
    up_desc = TensorDescriptor.from_tensor(w[n:], [c.block_n, c.block_k]) if gated else w_desc
    c_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    split = c.split_k
    if split > 1 and gated:
        raise ValueError("the gated form needs the whole K in one program (split_k 1)")
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else None
    part_block = [1, c.block_m, c.block_n]
    part_desc = TensorDescriptor.from_tensor(part, part_block) if part is not None else c_desc
    units = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n) * split
    grid = min(units, sm_count(x.device)) if x.is_cuda else units
    _gemm_kernel[(grid,)](
        a_desc, w_desc, up_desc, c_desc, part_desc, m, n, k, grid, split,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        GATED=gated, LIBDEVICE=not interpreting(), WARP_SPECIALIZE=c.warp_specialize,
        USE_PARTIALS=part is not None, num_stages=c.num_stages, num_warps=c.num_warps,
    )  # fmt: skip
    if part is not None:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=block
        )
    return out


def gemm_reference(x: torch.Tensor, w: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
    """Eager PyTorch: x @ w.T, then F.silu(gate) * up when gated."""
    y = x @ w.t()
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
