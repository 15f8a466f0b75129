"""One-row decode GEMV whose weight loads run ahead of the PDL wait (Hopper, Gluon).

The Triton GEMV of kernels/gemv.py starts loading weights only once its predecessor in the
decode step's PDL chain has finished (`griddepcontrol.wait`), so every launch pays a ramp (the
first bytes' latency) and a drain (the last tiles) with HBM partly idle. Here a one-warp
loader partition streams the weight tiles with TMA into a ring of shared-memory stages without
waiting for anything (weights do not depend on the predecessor): while the kernel before it
still runs, a resident program has already filled its ring. The compute partition waits for
the predecessor, then reads x (one row) and reduces each tile on CUDA cores in fp32.

Work units are (output tile, K split) pairs; a program walks units pid, pid + grid, ... with
one continuous ring, so a grid of at most one program per SM leaves room beside it for the
next kernel's programs (and their rings). Outputs: fp32 partials [split, 1, N] as
kernels/gemv.py's `_gemv_kernel` stores them, or the row itself when split == 1 and no
partials are asked for. Rounding differs from the tensor-core kernel only in the order of the
fp32 sums within a split.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.tensor_checks import next_power_of_2, pdl_launch, sm_count

# The compute partition's warps, and the registers a thread may hold: 12 warps (8 compute +
# the loader's warpgroup) at 80 keep over half the register file free for the next kernel's
# programs beside them.
COMPUTE_WARPS = 8
MAX_REGISTERS = 80
# Weight tiles the loader asks L2 for beyond the ring (0: none).
L2_PREFETCH_STEPS = 0


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise(
        "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _prefetch_tile(w_ptr, stride_wn, n0, k, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Ask L2 for one weight tile (a bulk prefetch per row, one row per lane)."""
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    rows = gl.arange(0, 32, layout=lanes)
    size = gl.full([32], BLOCK_K * 2, gl.int32, layout=lanes)
    for r in gl.static_range(BLOCK_N // 32):
        ptrs = w_ptr + (n0 + r * 32 + rows).to(gl.int64) * stride_wn + k
        gl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
            [ptrs, size], dtype=gl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@gluon.jit
def _loader(
    w_desc, w_ptr, stride_wn, bufs, ready, empty, n_units, split, steps,
    PREFETCH: gl.constexpr,
):  # fmt: skip
    """One warp: every weight tile of this program's units, in order, into the ring; with
    PREFETCH, the tile PREFETCH steps past each one into L2 as well (more bytes in flight
    than the ring holds)."""
    block_n: gl.constexpr = w_desc.block_type.shape[0]
    block_k: gl.constexpr = w_desc.block_type.shape[1]
    stages: gl.constexpr = bufs.type.shape[0]
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    i = 0
    for u in range(pid, n_units, grid):
        n0 = (u // split) * block_n
        k0 = (u % split) * steps * block_k
        for j in range(steps):
            if PREFETCH > 0:
                t = i + PREFETCH
                pu = pid + (t // steps) * grid
                if pu < n_units:
                    pk = ((pu % split) * steps + t % steps) * block_k
                    _prefetch_tile(w_ptr, stride_wn, (pu // split) * block_n, pk, block_n, block_k)
            s = i % stages
            mbarrier.wait(empty.index(s), ((i // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                w_desc, [n0, k0 + j * block_k], ready.index(s), bufs.index(s)
            )
            i += 1


@gluon.jit
def _stage_x(x_ptr, x_smem, k0, steps, K, GATED: gl.constexpr, layout: gl.constexpr):
    """x[k0 : k0 + steps * BLOCK_K] into x_smem [X_STEPS, BLOCK_K] (rows past `steps` are 0);
    gated: silu(gate) * up, rounded as kernels/gemv.py rounds."""
    x_steps: gl.constexpr = x_smem.type.shape[0]
    block_k: gl.constexpr = x_smem.type.shape[1]
    rows = gl.arange(0, x_steps, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, block_k, layout=gl.SliceLayout(0, layout))
    offs = k0 + rows[:, None] * block_k + cols[None, :]
    mask = (rows[:, None] < steps) & (cols[None, :] < block_k)
    x = gl.load(x_ptr + offs, mask=mask, other=0.0)
    if GATED:
        up = gl.load(x_ptr + K + offs, mask=mask, other=0.0).to(gl.float32)
        gate = x.to(gl.float32)
        act = gate / (1.0 + gl.exp(-gate))
        act = act.to(x.dtype, fp_downcast_rounding="rtne").to(gl.float32)
        x = (act * up).to(x.dtype, fp_downcast_rounding="rtne")
    x_smem.store(x)


@gluon.jit
def _compute(
    x_ptr, out_ptr, bufs, x_smem, ready, empty, n_units, split, steps, N, K,
    USE_PARTIALS: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    block_n: gl.constexpr = bufs.type.shape[1]
    block_k: gl.constexpr = bufs.type.shape[2]
    stages: gl.constexpr = bufs.type.shape[0]
    if PDL:  # only the compute waits for the predecessor: the loader is already streaming
        _gdc_wait()
        _gdc_launch_dependents()
    offs_n = gl.arange(0, block_n, layout=gl.SliceLayout(1, layout))
    # The same bytes (unswizzled, row-major) as a stack of rows, to index one K tile.
    x_rows = x_smem._reinterpret(
        x_smem.dtype, x_smem.type.shape, gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    staged = -1  # the K split whose x is in x_smem
    i = 0
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        ks = u % split
        if ks != staged:  # x once per split (a program's units share one split when the
            gl.thread_barrier()  # grid is a multiple of it), from L2 into shared memory
            _stage_x(x_ptr, x_smem, ks * steps * block_k, steps, K, GATED, layout)
            gl.thread_barrier()
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


@gluon.jit
def _gemv_ws_kernel(
    x_ptr, w_desc, w_ptr, stride_wn, out_ptr, n_units, split, steps, N, K,
    USE_PARTIALS: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr,
    STAGES: gl.constexpr, X_STEPS: gl.constexpr, PREFETCH: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    block_n: gl.constexpr = w_desc.block_type.shape[0]
    block_k: gl.constexpr = w_desc.block_type.shape[1]
    tpw_k: gl.constexpr = min(32, block_k // 8)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])
    bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, block_n, block_k], w_desc.layout)
    x_smem = gl.allocate_shared_memory(
        w_desc.dtype, [X_STEPS, block_k], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [
            (_compute, (x_ptr, out_ptr, bufs, x_smem, ready, empty, n_units, split, steps,
                        N, K, USE_PARTIALS, GATED, PDL, layout)),
            (_loader, (w_desc, w_ptr, stride_wn, bufs, ready, empty, n_units, split, steps,
                       PREFETCH)),
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
        and torch.cuda.get_device_capability(x.device)[0] >= 9
        and weight.shape[0] % block_n == 0
        and k % (split * block_k) == 0
        and weight.stride(1) == 1
        and (weight.stride(0) * weight.element_size()) % 16 == 0
        and x.data_ptr() % 16 == 0
    )


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
    (kernels/gemv.py) and `supported`. One program per SM at most."""
    n = weight.shape[0]
    units = (n // block_n) * split
    _gemv_ws_kernel[(min(units, sm_count(x.device)),)](
        x, weight_descriptor(weight, block_n, block_k), weight, weight.stride(0), out, units,
        split,
        k // (split * block_k), n, k,
        USE_PARTIALS=use_partials, GATED=gated, PDL=pdl, STAGES=stages,
        X_STEPS=next_power_of_2(k // (split * block_k)), PREFETCH=L2_PREFETCH_STEPS,
        num_warps=COMPUTE_WARPS,
        maxnreg=MAX_REGISTERS, **pdl_launch(pdl),
    )  # fmt: skip
