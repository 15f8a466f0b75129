"""Skinny decode products (2..64 rows) whose weight loads run ahead of the PDL wait (Hopper,
Gluon, warpgroup MMA).

kernels/gemv_ws.py streams one row's weights on CUDA cores; with more rows the products need
the tensor cores. Same structure: a one-warp loader partition streams [64, BLOCK_K] weight
tiles with TMA into a ring of shared-memory stages, starting before the predecessor in the
decode step's PDL chain has finished (weights do not depend on it), so each launch's ramp
overlaps the kernel before it. Once the predecessor is done (`griddepcontrol.wait` in the
loader) the loader also brings each stage its [M_PAD, BLOCK_K] tile of x (two for a gated x:
gate and up), which TMA reads from L2 and pads with zero rows past M.

The compute partition (one warpgroup) multiplies with the weights on the MMA's M side and the
rows on its N side (W_tile @ x_tile^T, the usual swap for skinny products: 8..64 rows fill the
instruction's N), accumulating in fp32 registers, one MMA in flight while the next stage
lands. A gated x is made silu(gate) * up in registers, rounded as kernels/gemv.py rounds, and
written to a shared buffer the MMA reads.

Work units are (64-row output tile, K split) pairs; a program walks units pid, pid + grid, ...
(grid: at most one program per SM). Outputs: fp32 partials [split, M, N] as kernels/gemv.py's
`_gemv_kernel` stores them, or [M, N] in x's dtype when no partials are asked for (split 1).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.tensor_checks import next_power_of_2, pdl_launch, sm_count, supports_pdl

BLOCK_N = 64  # one warpgroup MMA's M
BOX_K = 64  # one TMA box: a 128-byte swizzled row of bf16 / fp16
HALVES = 4  # 64-row MMAs a work unit runs on each x tile (one accumulator each)
TILE_N = HALVES * BLOCK_N  # a work unit's outputs
MAX_ROWS = 64  # the MMA's N for one warpgroup's accumulator at these tiles
COMPUTE_WARPS = 4  # one warpgroup
_BN = gl.constexpr(BLOCK_N)
_WARPS = gl.constexpr(COMPUTE_WARPS)
_NH = gl.constexpr(HALVES)

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def _asm(instruction: gl.constexpr):
    gl.inline_asm_elementwise(
        instruction + " // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _split_steps(u, split, k_steps):
    """The stage steps [j0, j1) of unit u's K split: split ks of k_steps, as even as whole
    steps allow (the splits differ by at most one step)."""
    ks = u % split
    return ks * k_steps // split, (ks + 1) * k_steps // split


@gluon.jit
def _load_weights(w_desc, w_bufs, bar, s, n0, k0, SUB: gl.constexpr):
    """Stage s's weight tiles: SUB K boxes of the tile's two 64-row halves."""
    box_k: gl.constexpr = w_desc.block_type.shape[1]
    for q in gl.static_range(SUB):
        for h in gl.static_range(_NH):
            at = (s * SUB + q) * _NH + h
            _tma_load(w_desc, [n0 + h * _BN, k0 + q * box_k], bar, w_bufs.index(at))


@gluon.jit
def _mma_loader(
    w_desc, x_desc, w_bufs, x_bufs, ready, empty, n_units, split, k_steps, K,
    SUB: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    box_k: gl.constexpr = w_desc.block_type.shape[1]
    stage_k: gl.constexpr = SUB * box_k
    stages: gl.constexpr = w_bufs.type.shape[0] // (_NH * SUB)
    x_tiles: gl.constexpr = 2 if GATED else 1
    w_bytes: gl.constexpr = _NH * w_desc.block_type.nbytes
    nbytes: gl.constexpr = SUB * (w_bytes + x_tiles * x_desc.block_type.nbytes)
    # Ahead of the predecessor: the ring's first weight tiles (they depend on nothing).
    i = 0
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        j0, j1 = _split_steps(u, split, k_steps)
        for j in range(j0, j1):
            if i < stages:
                mbarrier.expect(ready.index(i), nbytes)
                n0 = (u // split) * (_NH * _BN)
                _load_weights(w_desc, w_bufs, ready.index(i), i, n0, j * stage_k, SUB)
            i += 1
    if PDL:
        _asm("griddepcontrol.wait;")
    i = 0
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        j0, j1 = _split_steps(u, split, k_steps)
        n0 = (u // split) * (_NH * _BN)
        for j in range(j0, j1):
            s = i % stages
            k0 = j * stage_k
            if i >= stages:
                mbarrier.wait(empty.index(s), ((i // stages) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                _load_weights(w_desc, w_bufs, ready.index(s), s, n0, k0, SUB)
            for q in gl.static_range(SUB):
                at = (s * SUB + q) * x_tiles
                _tma_load(x_desc, [0, k0 + q * box_k], ready.index(s), x_bufs.index(at))
                if GATED:
                    _tma_load(x_desc, [0, K + k0 + q * box_k], ready.index(s), x_bufs.index(at + 1))
            i += 1


@gluon.jit
def _gated_rows(x_bufs, s, act_bufs, a0, SUB: gl.constexpr, layout: gl.constexpr):
    """silu(gate) * up of stage s's x tiles into act_bufs[a0 : a0 + SUB], rounded as
    kernels/gemv.py rounds."""
    for q in gl.static_range(SUB):
        gate = x_bufs.index(2 * (s * SUB + q)).load(layout)
        up = x_bufs.index(2 * (s * SUB + q) + 1).load(layout)
        g = gate.to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(gate.dtype, fp_downcast_rounding="rtne")
        prod = act.to(gl.float32) * up.to(gl.float32)
        act_bufs.index(a0 + q).store(prod.to(gate.dtype, fp_downcast_rounding="rtne"))
    fence_async_shared()
    _cta_barrier()  # every thread's rows written before the warpgroup's MMA reads them


@gluon.jit
def _store_rows(out_ptr, acc, n, m, split_index, M, N, USE_PARTIALS: gl.constexpr):
    """acc [64, M_PAD] (outputs n of rows m) into the partials [split, M, N] or [M, N]."""
    mask = m[None, :] < M
    at = m[None, :] * N + n[:, None]
    if USE_PARTIALS:
        gl.store(out_ptr + split_index * M * N + at, acc, mask=mask)
    else:
        gl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _mma_compute(
    out_ptr, w_bufs, x_bufs, act_bufs, ready, empty, n_units, split, k_steps, M, N,
    SUB: gl.constexpr, USE_PARTIALS: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    if PDL:  # nothing is read from the predecessor here, but the stores must follow it
        _asm("griddepcontrol.wait;")
        _asm("griddepcontrol.launch_dependents;")
    stages: gl.constexpr = w_bufs.type.shape[0] // (_NH * SUB)
    m_pad: gl.constexpr = x_bufs.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[_WARPS, 1], instr_shape=[16, m_pad, 16]
    )
    x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_WARPS, 1], [1, 0])
    offs_n = gl.arange(0, _BN, layout=gl.SliceLayout(1, acc_layout))
    offs_m = gl.arange(0, m_pad, layout=gl.SliceLayout(0, acc_layout))
    i = 0
    for u in range(gl.program_id(0), n_units, gl.num_programs(0)):
        acc0 = gl.zeros([_BN, m_pad], gl.float32, layout=acc_layout)  # the tile's 64-row parts
        acc1 = gl.zeros([_BN, m_pad], gl.float32, layout=acc_layout)
        acc2 = gl.zeros([_BN, m_pad], gl.float32, layout=acc_layout)
        acc3 = gl.zeros([_BN, m_pad], gl.float32, layout=acc_layout)
        prev = 0
        j0, j1 = _split_steps(u, split, k_steps)
        for j in range(j0, j1):
            s = i % stages
            mbarrier.wait(ready.index(s), (i // stages) & 1)
            if GATED:  # stage j - 2's MMAs, the last to read these buffers, are done
                _gated_rows(x_bufs, s, act_bufs, (i % 2) * SUB, SUB, x_layout)
            for q in gl.static_range(SUB):
                b = act_bufs.index((i % 2) * SUB + q) if GATED else x_bufs.index(s * SUB + q)
                bt = b.permute((1, 0))
                w = (s * SUB + q) * _NH
                acc0 = warpgroup_mma(w_bufs.index(w), bt, acc0, is_async=True)
                acc1 = warpgroup_mma(w_bufs.index(w + 1), bt, acc1, is_async=True)
                acc2 = warpgroup_mma(w_bufs.index(w + 2), bt, acc2, is_async=True)
                acc3 = warpgroup_mma(w_bufs.index(w + 3), bt, acc3, is_async=True)
            # the previous stage's MMAs are done
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(_NH * SUB, deps=[acc0, acc1, acc2, acc3])
            if j > j0:
                mbarrier.arrive(empty.index(prev), count=1)
            prev = s
            i += 1
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=[acc0, acc1, acc2, acc3])
        mbarrier.arrive(empty.index(prev), count=1)
        n0 = (u // split) * (_NH * _BN)
        ks = u % split
        _store_rows(out_ptr, acc0, n0 + offs_n, offs_m, ks, M, N, USE_PARTIALS)
        _store_rows(out_ptr, acc1, n0 + _BN + offs_n, offs_m, ks, M, N, USE_PARTIALS)
        _store_rows(out_ptr, acc2, n0 + 2 * _BN + offs_n, offs_m, ks, M, N, USE_PARTIALS)
        _store_rows(out_ptr, acc3, n0 + 3 * _BN + offs_n, offs_m, ks, M, N, USE_PARTIALS)


@gluon.jit
def _gemv_mma_kernel(
    w_desc, x_desc, out_ptr, n_units, split, k_steps, M, N, K,
    USE_PARTIALS: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr,
    STAGES: gl.constexpr, SUB: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    box_k: gl.constexpr = w_desc.block_type.shape[1]
    m_pad: gl.constexpr = x_desc.block_type.shape[0]
    x_tiles: gl.constexpr = 2 if GATED else 1
    w_bufs = gl.allocate_shared_memory(
        w_desc.dtype, [_NH * STAGES * SUB, _BN, box_k], w_desc.layout
    )
    x_bufs = gl.allocate_shared_memory(
        x_desc.dtype, [x_tiles * STAGES * SUB, m_pad, box_k], x_desc.layout
    )
    act_bufs = gl.allocate_shared_memory(
        x_desc.dtype, [2 * SUB if GATED else 1, m_pad, box_k], x_desc.layout
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [
            (_mma_compute, (out_ptr, w_bufs, x_bufs, act_bufs, ready, empty, n_units, split,
                            k_steps, M, N, SUB, USE_PARTIALS, GATED, PDL)),
            (_mma_loader, (w_desc, x_desc, w_bufs, x_bufs, ready, empty, n_units, split,
                           k_steps, K, SUB, GATED, PDL)),
        ],
        [1],
        [40],
    )  # fmt: skip


def _tile_layout() -> gl.NVMMASharedLayout:
    """128-byte swizzled [rows, 64] bf16/fp16 tiles: what TMA writes and the MMA reads."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


_DESCRIPTORS: dict[tuple[int, tuple[int, ...]], TensorDescriptor] = {}


def weight_descriptor(weight: torch.Tensor) -> TensorDescriptor:
    """The weight's TMA descriptor for [64, BOX_K] swizzled tiles (cached per weight)."""
    key = (weight.data_ptr(), tuple(weight.shape))
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        desc = TensorDescriptor.from_tensor(weight, [BLOCK_N, BOX_K], _tile_layout())
        _DESCRIPTORS[key] = desc
    return desc


def padded_rows(m: int) -> int:
    """The MMA's N for m rows: a power of two from 8."""
    return max(8, next_power_of_2(m))


def shared_bytes(rows: int, stage_k: int, stages: int, gated: bool) -> int:
    """The ring's shared memory: per stage the weight tiles and x's (two if gated), and a
    gated x's two stages of products."""
    x_tile = padded_rows(rows) * stage_k * 2
    stage = TILE_N * stage_k * 2 + (2 if gated else 1) * x_tile
    return stages * stage + (2 * x_tile if gated else 0)


def supported(x: torch.Tensor, weight: torch.Tensor, k: int, stage_k: int, split: int) -> bool:
    """Whether this kernel takes the product: 2..64 bf16/fp16 rows on Hopper+, whole tiles
    (stage_k, the K a ring stage holds, a multiple of BOX_K), TMA-aligned operands (rows'
    pitch and base 16-byte aligned)."""
    return (
        x.is_cuda
        and 2 <= x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and stage_k % BOX_K == 0
        and supports_pdl(x.device)  # sm_90+, the device's properties looked up once
        and weight.shape[0] % TILE_N == 0
        and k % stage_k == 0
        and split <= k // stage_k  # no empty split
        and weight.stride(1) == 1
        and (weight.stride(0) * weight.element_size()) % 16 == 0
        and x.stride(1) == 1
        and (x.stride(0) * x.element_size()) % 16 == 0
        and x.data_ptr() % 16 == 0
    )


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    k: int,
    ring: tuple[int, int],
    split: int,
    use_partials: bool,
    gated: bool,
    pdl: bool,
) -> None:
    """y = x @ weight^T (gated: silu(gate) * up of x = [gate | up]) for M rows into `out`
    ([M, N] contiguous, x's dtype) or, use_partials, its fp32 split-K partials into `out`
    ([split, M, N]). ring: (K a stage holds, stages). The caller has checked the operands
    (kernels/gemv.py) and `supported`."""
    m, n = x.shape[0], weight.shape[0]
    stage_k, stages = ring
    units = (n // TILE_N) * split
    x_desc = TensorDescriptor.from_tensor(x, [padded_rows(m), BOX_K], _tile_layout())
    _gemv_mma_kernel[(min(units, sm_count(x.device)),)](
        weight_descriptor(weight), x_desc, out, units, split, k // stage_k,
        m, n, k, USE_PARTIALS=use_partials, GATED=gated, PDL=pdl, STAGES=stages,
        SUB=stage_k // BOX_K, num_warps=COMPUTE_WARPS, **pdl_launch(pdl),
    )  # fmt: skip
