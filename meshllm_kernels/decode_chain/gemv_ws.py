"""One-row decode GEMVs whose weight loads run ahead of the PDL wait (Hopper, Gluon).

The Triton GEMV of meshllm_kernels/decode_chain/gemv.py starts loading weights only once its
predecessor in the decode step's PDL chain has finished (`griddepcontrol.wait`), so every launch
pays a ramp (the first bytes' latency) and a drain (the last tiles) with HBM partly idle. Here a
one-warp loader partition streams the weight tiles with TMA into a ring of shared-memory stages
without waiting for anything (weights do not depend on the predecessor): as soon as a program is
resident its ring fills, while the kernel before it may still be finishing. The compute
partition (8 warps) waits for the predecessor, stages x (one row; gated: silu(gate) * up) in
shared memory once per K split, then multiplies each tile on CUDA cores into an fp32
[block_n, block_k] accumulator that it sums over K once per output tile.

Work units are (output tile, K split) pairs; a program walks units pid, pid + grid, ... with
one continuous ring (grid: at most one program per SM). Outputs: fp32 partials [split, 1, N] as
meshllm_kernels/decode_chain/gemv.py's `_gemv_kernel` stores them, or the row itself in x's dtype
when split == 1 and no partials are asked for. Rounding differs from the tensor-core kernel only in
the order of the fp32 sums within a split.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from meshllm_kernels.runtime.tensor_checks import (
    next_power_of_2,
    pdl_launch,
    sm_count,
    supports_pdl,
)

# The compute partition's warps, and the registers a thread may hold (12 warps: 8 compute and
# the loader's warpgroup).
COMPUTE_WARPS = 8
MAX_REGISTERS = 80


@gluon.jit
def _asm(instruction: gl.constexpr):
    gl.inline_asm_elementwise(
        instruction + " // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


# Gluon's names moved after Triton 3.6 (the H200's): _reinterpret -> reinterpret,
# thread_barrier -> barrier, tma.async_copy_global_to_shared -> tma.async_load. These are the
# ones this Triton has (tests/kernels/test_gemv_ws_compiles.py compiles the kernel with them).
_reinterpret = (
    getattr(gl.shared_memory_descriptor, "reinterpret", None)
    or gl.shared_memory_descriptor._reinterpret
)
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _load_units(w_desc, bufs, ready, empty, i, n_units, split, steps):
    """The loader's walk over one product: every weight tile of this program's units, in
    order, into the ring (slot i % stages onwards); returns the next ring position."""
    block_n: gl.constexpr = w_desc.block_type.shape[0]
    block_k: gl.constexpr = w_desc.block_type.shape[1]
    stages: gl.constexpr = bufs.type.shape[0]
    i = gl.to_tensor(i)
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        n0 = (u // split) * block_n
        k0 = (u % split) * steps * block_k
        for j in range(steps):
            s = i % stages
            mbarrier.wait(empty.index(s), ((i // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
            _tma_load(w_desc, [n0, k0 + j * block_k], ready.index(s), bufs.index(s))
            i += 1
    return i


@gluon.jit
def _stage_x(
    x_ptr, x_smem, k0, steps, K, GATED: gl.constexpr, CACHE: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    """x[k0 : k0 + steps * BLOCK_K] into x_smem [X_STEPS, BLOCK_K] (rows past `steps` are 0);
    gated: silu(gate) * up, rounded as meshllm_kernels/decode_chain/gemv.py rounds."""
    x_steps: gl.constexpr = x_smem.type.shape[0]
    block_k: gl.constexpr = x_smem.type.shape[1]
    rows = gl.arange(0, x_steps, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, block_k, layout=gl.SliceLayout(0, layout))
    offs = k0 + rows[:, None] * block_k + cols[None, :]
    mask = (rows[:, None] < steps) & (cols[None, :] < block_k)
    x = gl.load(x_ptr + offs, mask=mask, other=0.0, cache_modifier=CACHE)
    if GATED:
        up = gl.load(x_ptr + K + offs, mask=mask, other=0.0, cache_modifier=CACHE)
        gate = x.to(gl.float32)
        act = gate / (1.0 + gl.exp(-gate))
        act = act.to(x.dtype, fp_downcast_rounding="rtne").to(gl.float32)
        x = (act * up.to(gl.float32)).to(x.dtype, fp_downcast_rounding="rtne")
    x_smem.store(x)


@gluon.jit
def _as_rows(x_smem):
    """x_smem's bytes (unswizzled, row-major) as a stack of rows, to index one K tile."""
    return _reinterpret(
        x_smem, x_smem.dtype, x_smem.type.shape, gl.SwizzledSharedLayout(1, 1, 1, [0])
    )


@gluon.jit
def _compute_units(
    x_ptr, out_ptr, bufs, x_smem, ready, empty, i, n_units, split, steps, N, K,
    USE_PARTIALS: gl.constexpr, GATED: gl.constexpr, CACHE: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    """The compute partition's walk over one product (ring position i onwards): x staged
    once per K split, each unit's tiles multiplied into an fp32 tile, summed over K, stored.
    Returns the next ring position."""
    block_n: gl.constexpr = bufs.type.shape[1]
    block_k: gl.constexpr = bufs.type.shape[2]
    stages: gl.constexpr = bufs.type.shape[0]
    offs_n = gl.arange(0, block_n, layout=gl.SliceLayout(1, layout))
    x_rows = _as_rows(x_smem)
    staged = -1  # the K split whose x is in x_smem
    i = gl.to_tensor(i)
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        ks = u % split
        if ks != staged:  # once per split: a program's units share one when the grid is a
            _cta_barrier()  # multiple of it
            _stage_x(x_ptr, x_smem, ks * steps * block_k, steps, K, GATED, CACHE, layout)
            _cta_barrier()
            staged = ks
        # Elementwise fp32 products, summed over K once per unit: no shuffles per tile.
        acc = gl.zeros([block_n, block_k], gl.float32, layout=layout)
        for j in range(steps):
            x = x_rows.index(j).load(gl.SliceLayout(0, layout)).to(gl.float32)
            s = i % stages
            mbarrier.wait(ready.index(s), (i // stages) & 1)
            w = bufs.index(s).load(layout)
            mbarrier.arrive(empty.index(s), count=1)
            acc += w.to(gl.float32) * x[None, :]
            i += 1
        rows = (u // split) * block_n + offs_n
        y = gl.sum(acc, axis=1)
        if USE_PARTIALS:
            gl.store(out_ptr + ks * N + rows, y)
        else:
            gl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))
    return i


@gluon.jit
def _wait_predecessor(PDL: gl.constexpr):
    if PDL:  # only the compute waits for the predecessor: the loader is already streaming
        _asm("griddepcontrol.wait;")
        _asm("griddepcontrol.launch_dependents;")


@gluon.jit
def _gemv_compute(
    x_ptr, out_ptr, bufs, x_smem, ready, empty, n_units, split, steps, N, K,
    USE_PARTIALS: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    _wait_predecessor(PDL)
    _compute_units(
        x_ptr, out_ptr, bufs, x_smem, ready, empty, 0, n_units, split, steps, N, K,
        USE_PARTIALS, GATED, "", layout,
    )  # fmt: skip


@gluon.jit
def _gemv_loader(w_desc, bufs, ready, empty, n_units, split, steps):
    _load_units(w_desc, bufs, ready, empty, 0, n_units, split, steps)


@constexpr_function
def _tile_layout(block_k, num_warps):
    """Each thread 8 contiguous K elements of a row; a warp 32 // (block_k / 8) rows."""
    tpw_k = min(32, block_k // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])


@gluon.jit
def _ring(desc, STAGES: gl.constexpr, X_STEPS: gl.constexpr):
    """The weight ring, x's buffer and the ring's barriers."""
    block_n: gl.constexpr = desc.block_type.shape[0]
    block_k: gl.constexpr = desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, block_n, block_k], desc.layout)
    x_smem = gl.allocate_shared_memory(
        desc.dtype, [X_STEPS, block_k], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return bufs, x_smem, ready, empty


@gluon.jit
def _gemv_ws_kernel(
    x_ptr, w_desc, out_ptr, n_units, split, steps, N, K,
    USE_PARTIALS: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr,
    STAGES: gl.constexpr, X_STEPS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    layout: gl.constexpr = _tile_layout(w_desc.block_type.shape[1], num_warps)
    bufs, x_smem, ready, empty = _ring(w_desc, STAGES, X_STEPS)
    gl.warp_specialize(
        [
            (_gemv_compute, (x_ptr, out_ptr, bufs, x_smem, ready, empty, n_units, split,
                             steps, N, K, USE_PARTIALS, GATED, PDL, layout)),
            (_gemv_loader, (w_desc, bufs, ready, empty, n_units, split, steps)),
        ],
        [1],
        [40],
    )  # fmt: skip


_DESCRIPTORS: dict[tuple[int, tuple[int, ...], int, int], TensorDescriptor] = {}


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The weight's TMA descriptor for [block_n, block_k] tiles (cached per weight)."""
    key = (weight.data_ptr(), tuple(weight.shape), block_n, block_k)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        desc = TensorDescriptor.from_tensor(weight, [block_n, block_k], layout)
        _DESCRIPTORS[key] = desc
    return desc


def supported(
    x: torch.Tensor, weight: torch.Tensor, k: int, block_n: int, block_k: int, split: int
) -> bool:
    """Whether this kernel takes the product: one bf16/fp16 row on Hopper+, whole tiles."""
    return (
        x.is_cuda
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and supports_pdl(x.device)  # sm_90+, the device's properties looked up once
        and weight.shape[0] % block_n == 0
        and k % (split * block_k) == 0
        and weight.stride(1) == 1
        and (weight.stride(0) * weight.element_size()) % 16 == 0
        and x.data_ptr() % 16 == 0
    )


def _steps(k: int, split: int, block_k: int) -> int:
    return k // (split * block_k)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    k: int,
    block_n: int,
    block_k: int,
    split: int,
    stages: int,
    use_partials: bool,
    gated: bool,
    pdl: bool,
) -> None:
    """y = x @ weight^T for one row into `out` ([1, N] in x's dtype) or, use_partials, its
    fp32 split-K partials into `out` ([split, 1, N]). The caller has checked the operands
    (meshllm_kernels/decode_chain/gemv.py) and `supported`. One program per SM at most."""
    n = weight.shape[0]
    units = (n // block_n) * split
    steps = _steps(k, split, block_k)
    _gemv_ws_kernel[(min(units, sm_count(x.device)),)](
        x, weight_descriptor(weight, block_n, block_k), out, units, split, steps, n, k,
        USE_PARTIALS=use_partials, GATED=gated, PDL=pdl, STAGES=stages,
        X_STEPS=next_power_of_2(steps), num_warps=COMPUTE_WARPS, maxnreg=MAX_REGISTERS,
        **pdl_launch(pdl),
    )  # fmt: skip
