"""Decode GEMV / skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T for M = 1..128, and its reference.

At decode batch sizes the weights dominate the bytes moved (W is N*K, x and y are M*(N+K)), so
the kernel is bound by weight bandwidth: every weight element is read exactly once, in
16-byte-wide rows along K, and nothing else is re-read from HBM (x is small and stays in L2).
The product is computed as W_tile @ x^T so the big dimension N feeds the tensor cores' M side
and the batch, padded to 16 (up to 16 rows: the tiles tuned on the H200) or to the next power
of two, their N side; accumulation is fp32. Past 16 rows the x tile grows with the batch, so
fewer pipeline stages fit in shared memory (`_rows_launch`); the serving path routes steps of
more than 16 rows here only where the worker is told to (services/worker/accel/cuda_layers.py).

Too few output tiles (N / BLOCK_N) to fill the GPU are made up for by split-K: SPLIT_K
programs share a tile, each covering a K range, writing fp32 partials [SPLIT_K, M, N] that a
reduce kernel sums in a fixed order. The result is therefore deterministic (atomics would sum
in arrival order) at the cost of one small extra pass (SPLIT_K*M*N*4 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from meshllm_kernels.layers.rmsnorm import (
    MAX_HIDDEN,
    add_rmsnorm_row,
    check_norm_inputs,
    norm_warps,
)
from meshllm_kernels.runtime.pdl import chain_handoff
from meshllm_kernels.runtime.specialization import jit_options
from meshllm_kernels.runtime.tensor_checks import (
    check_tensor,
    interpreting,
    next_power_of_2,
    pdl_launch,
    sm_count,
    supports_pdl,
)

MAX_BATCH = 128
TUNED_BATCH = 16  # the BLOCK_M of the H200 sweeps below: every batch up to it
SMEM_BUDGET = 200 * 1024  # bytes of pipeline buffers a program may use (228 KB on Hopper)
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


# Tiles swept on the H200 (CUDA-graph times at batch 1 and 16, weights streamed from HBM) for
# the Llama-3-8B layer shapes (N, K). Other shapes use `heuristic_config`, which reproduces the
# split factors found here.
H200_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (4096, 4096): GemvConfig(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=4),
    (1024, 4096): GemvConfig(block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4),
    (14336, 4096): GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=4),
    # The fused gate_up of the model, swept inside the 32-layer decode chain rather than alone.
    (28672, 4096): GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3),
    (4096, 14336): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4),
    (128256, 4096): GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=4),
}

# One-row products of these shapes on Hopper go to meshllm_kernels/decode_chain/gemv_ws.py (weight
# loads ahead of the PDL wait) with these tiles: (block_n, block_k, split, stages = num_stages), the
# work units spread evenly over 132 programs. Every other product (more rows, other shapes, the
# LM head, a caller's own config, a device without TMA) runs the tensor-core kernel.
WS_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (6144, 4096): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=9),
    (4096, 4096): GemvConfig(block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=9),
    (28672, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=9),
    (4096, 14336): GemvConfig(block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=9),
}


# M, the rows, follows the step (the logits rows of a prefill chunk: 1, 16, ...): not
# specialized, so every row count up to a BLOCK_M is the one kernel the warm-up compiled.
@triton.jit(**jit_options(values=["M"]))
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PARTIALS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    GATED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    chain_handoff(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_valid = offs_n < N
    m_valid = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K and EVEN_N:
            w = tl.load(w_rows + offs_k[None, :])
        else:
            w = tl.load(
                w_rows + offs_k[None, :],
                mask=n_valid[:, None] & (offs_k < k_end)[None, :],
                other=0.0,
            )
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        x_mask = m_valid[None, :] & (offs_k < k_end)[:, None]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if GATED:  # x holds [gate | up]: the input is silu(gate) * up, rounded as eager rounds
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            act = gate / (1.0 + tl.exp(-gate))
            act = act.to(x.dtype, fp_downcast_rounding="rtne").to(tl.float32)
            x = (act * up).to(x.dtype, fp_downcast_rounding="rtne")
        if FP32_DOT:
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w, x)
    mask = n_valid[:, None] & m_valid[None, :]
    if not USE_PARTIALS:
        tl.store(
            out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        part = part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part, acc, mask=mask)


@triton.jit(**jit_options(values=["M"]))
def _split_k_reduce_kernel(
    part_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    chain_handoff(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=valid, other=0.0)
    m = offs // N
    n = offs % N
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit(**jit_options(values=["M"]))
def _split_k_norm_kernel(
    part_ptr,
    residual_ptr,
    norm_weight_ptr,
    normed_ptr,
    stream_ptr,
    M,
    N,
    eps,
    stride_r,
    stride_o,
    stride_s,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One row: the partials summed in the reduce kernel's order and rounded as it rounds,
    then the residual add and RMSNorm of meshllm_kernels/layers/rmsnorm.py."""
    chain_handoff(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    x = acc.to(normed_ptr.dtype.element_ty).to(tl.float32)
    add_rmsnorm_row(
        x, residual_ptr + row * stride_r, norm_weight_ptr, normed_ptr + row * stride_o,
        stream_ptr + row * stride_s, offs, mask, eps, N, True,
    )  # fmt: skip


def heuristic_config(n: int, k: int, num_sms: int) -> GemvConfig:
    """Split K until the tiles about fill the SMs once and no split walks more than 32
    K-steps, keeping at least 4 K-steps per split (the split factors of H200_CONFIGS)."""
    block_n, block_k = 64, 128
    tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split = 1
    while (
        split < 16
        and steps // (split * 2) >= 4
        and (tiles * split < 0.9 * num_sms or steps // split > 32)
    ):
        split *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split)


@dataclass(frozen=True)
class _GemvLaunch:
    """A checked product: its operands, K (the weight's width) and the tile config."""

    x: torch.Tensor
    weight: torch.Tensor
    k: int
    config: GemvConfig
    gated: bool
    pdl: bool
    ws: bool = False

    @property
    def k_per_split(self) -> int:
        cfg = self.config
        return triton.cdiv(triton.cdiv(self.k, cfg.split_k), cfg.block_k) * cfg.block_k

    @property
    def split(self) -> int:
        return triton.cdiv(self.k, self.k_per_split)


def _checked(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None,
    gated: bool,
) -> _GemvLaunch:
    x = check_tensor("x", x, dtypes=WEIGHT_DTYPES, ndim=2, last_dim_contiguous=True)
    weight = check_tensor(
        "weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device, last_dim_contiguous=True
    )
    m, k = x.shape
    n = weight.shape[0]
    if gated:
        if k % 2:
            raise ValueError(f"gated gemv takes x = [gate | up], an even width; got {k}")
        k //= 2
    if weight.shape[1] != k:
        what = "half of x (gate | up) has" if gated else "x has"
        raise ValueError(f"weight is [N, K] = {tuple(weight.shape)} but {what} K = {k}")
    if not 1 <= m <= MAX_BATCH:
        raise ValueError(f"gemv takes 1..{MAX_BATCH} rows, got {m}; use a GEMM for more")
    if n == 0 or k == 0:
        raise ValueError(f"empty product: weight shape {tuple(weight.shape)}")
    cfg = config or H200_CONFIGS.get((n, k)) or heuristic_config(n, k, sm_count(x.device))
    if cfg.split_k < 1 or cfg.block_k < 16 or cfg.block_n < 16:
        raise ValueError(f"invalid gemv config {cfg}")
    if interpreting():
        cfg = GemvConfig(cfg.block_n, min(cfg.block_k, 64), cfg.split_k, cfg.num_warps, 1)
    # in the decode step's PDL chain (meshllm_kernels/runtime/pdl.py)
    use_pdl = supports_pdl(x.device)
    ws_cfg = WS_CONFIGS.get((n, k)) if config is None and x.is_cuda else None
    if ws_cfg is not None and use_pdl:  # sm_90+ (cached device lookup)
        # Gluon, Hopper+: imported only where it can run
        from meshllm_kernels.decode_chain import gemv_ws

        if gemv_ws.supported(x, weight, k, ws_cfg.block_n, ws_cfg.block_k, ws_cfg.split_k):
            return _GemvLaunch(x, weight, k, ws_cfg, gated, use_pdl, ws=True)
    return _GemvLaunch(x, weight, k, cfg, gated, use_pdl)


def _launch_product(g: _GemvLaunch, out: torch.Tensor, part: torch.Tensor | None) -> None:
    """The GEMV kernel: into `out` directly, or fp32 partials [split, M, N] into `part`."""
    x, weight, cfg, k = g.x, g.weight, g.config, g.k
    m, n = x.shape[0], weight.shape[0]
    if g.ws:
        from meshllm_kernels.decode_chain import gemv_ws

        gemv_ws.launch(
            x, weight, part if part is not None else out, k=k, block_n=cfg.block_n,
            block_k=cfg.block_k, split=g.split, stages=cfg.num_stages,
            use_partials=part is not None, gated=g.gated, pdl=g.pdl,
        )  # fmt: skip
        return
    block_m, num_warps, num_stages = _rows_launch(m, cfg, x.element_size(), g.gated)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), g.split)](
        x, weight, out, part if part is not None else out, m, n, k, g.k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_PARTIALS=part is not None,
        EVEN_K=k % g.k_per_split == 0 and g.k_per_split % cfg.block_k == 0,
        EVEN_N=n % cfg.block_n == 0,
        FP32_DOT=interpreting() or x.dtype == torch.float32, GATED=g.gated, PDL=g.pdl,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(g.pdl),
    )  # fmt: skip


def _rows_launch(
    m: int, cfg: GemvConfig, element_size: int, gated: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_M, warps, stages) for m rows: the tuned launch up to 16 rows; past it the batch
    padded to a power of two, a warp per 2,048 accumulator elements (at least the config's),
    and as many of the config's stages as fit SMEM_BUDGET with every tile of a stage: W's and
    x's, and for a gated product x's second half (`up`, loaded beside `gate`)."""
    if m <= TUNED_BATCH:
        return TUNED_BATCH, cfg.num_warps, cfg.num_stages
    block_m = next_power_of_2(m)
    num_warps = max(cfg.num_warps, min(8, cfg.block_n * block_m // 2048))
    x_tiles = 2 if gated else 1
    per_stage = (cfg.block_n + x_tiles * block_m) * cfg.block_k * element_size
    return block_m, num_warps, max(1, min(cfg.num_stages, SMEM_BUDGET // per_stage))


def _partials(g: _GemvLaunch) -> torch.Tensor:
    """The product's fp32 split-K partials [split, M, N], launched."""
    part = torch.empty(
        g.split, g.x.shape[0], g.weight.shape[0], dtype=torch.float32, device=g.x.device
    )
    _launch_product(g, part, part)
    return part


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    gated: bool = False,
) -> torch.Tensor:
    """x [M, K] (M <= 128) times weight [N, K] transposed; returns [M, N] in x's dtype.

    gated: x is [M, 2K], a gated MLP's [gate | up], and the product is silu(gate) * up times
    weight^T (the down projection with its activation fused into the loads of x: no
    [M, K] intermediate and two elementwise launches fewer), rounded at the same points as
    `F.silu(gate) * up` in x's dtype.

    Launched in the decode step's PDL chain where the device supports it."""
    g = _checked(x, weight, config, gated)
    m, n = g.x.shape[0], g.weight.shape[0]
    out = torch.empty(m, n, dtype=g.x.dtype, device=g.x.device)
    if g.split == 1:
        _launch_product(g, out, None)
        return out
    part = _partials(g)
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, out, m, n, out.stride(0),
        SPLIT_K=g.split, BLOCK=block, PDL=g.pdl, **pdl_launch(g.pdl),
    )  # fmt: skip
    return out


def gemv_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """The product's fp32 split-K partials [split, M, N] (split 1: the whole accumulator), for
    a kernel that sums them itself in the reduce kernel's order and rounds as it rounds (the
    decode attention of meshllm_kernels/decode_chain/decode_from_qkv.py)."""
    return _partials(_checked(x, weight, config, False))


def gemv_add_rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    config: GemvConfig | None = None,
    *,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of `gemv`, added to the residual stream, then RMSNorm'd: returns (normed,
    stream) with stream = residual + x @ weight^T and normed = rmsnorm(stream) * norm_weight,
    rounded exactly as `gemv` followed by `meshllm_kernels.layers.rmsnorm.rmsnorm(out, norm_weight,
    eps, residual)`, in two launches instead of three: the split-K partials are summed by the
    norm's kernel (one program per row) rather than by a reduce kernel of their own. The
    decode step's o and down projections run this way (services/worker/accel/decode_chain.py)."""
    g = _checked(x, weight, config, gated)
    m, n = g.x.shape[0], g.weight.shape[0]
    checked, norm_weight = check_norm_inputs(g.x, (m, n), norm_weight, eps, residual)
    if checked is None:
        raise ValueError("gemv_add_rmsnorm needs the residual stream")
    residual = checked
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size must be in 1..{MAX_HIDDEN}, got {n}")
    part = _partials(g)
    normed = torch.empty(m, n, dtype=g.x.dtype, device=g.x.device)
    stream = torch.empty_like(normed)
    block = next_power_of_2(n)
    _split_k_norm_kernel[(m,)](
        part, residual, norm_weight, normed, stream, m, n, float(eps),
        residual.stride(0), normed.stride(0), stream.stride(0),
        SPLIT_K=g.split, BLOCK=block, PDL=g.pdl,
        num_warps=norm_warps(block), **pdl_launch(g.pdl),
    )  # fmt: skip
    return normed, stream


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
    """fp32 product rounded to x's dtype (gated: of F.silu(gate) * up, as the eager MLP)."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return (x.float() @ weight.float().t()).to(x.dtype)
