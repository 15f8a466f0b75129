"""Decode GEMV whose input is normalized inside the product: y = rmsnorm(stream) @ W^T, where
stream = residual + (the previous projection's split-K partials, summed).

In the decode chain (services/worker/decode_chain.py) a projection's partials are summed by
the RMSNorm kernel that follows it (`kernels.gemv.gemv_add_rmsnorm`), and the next GEMV reads
that norm's output. At batch 1 that norm is one program on one SM: a serial stage of a few
microseconds (plus a kernel hand-off) between two weight streams, during which HBM idles, 64
times a step. Here the next GEMV does the norm's work itself, without a stage of its own:

- every program walks the whole K range (split 1) and, at each K-step, sums the partials of
  its x tile in the reduce kernel's order, rounds them, adds the residual and rounds as
  `kernels.rmsnorm.add_rmsnorm_row` does (so the stream is bit-identical to the norm's), and
  accumulates the squares next to the product (summed over K once, after the loop: a
  reduction inside the loop stalls the weight pipeline every K-step, 2.5x slower on the H200);
- the norm's scale is a per-row scalar, so it is applied once to the fp32 accumulator at the
  end: y = (W @ dtype(stream * norm_weight)^T) * rsqrt(mean(stream^2) + eps). The weights
  stream from the first K-step on; nothing waits for the row's norm;
- the programs also store the new stream (the next residual), a K-tile each, after their
  loop: a store inside it would stop the weight loads being issued ahead (the first H200
  call of this kernel, with the store in the loop: a batch-1 step graph of 9.3 ms against
  3.9 without the kernel).

The rounding of the normed input therefore differs from the unfused chain's (that rounds
stream * rsqrt first, then times the weight): results agree within bf16 tolerance, not bit for
bit (tests/kernels/test_gemv_norm_in.py checks both against an fp32 reference).

Each program re-reads its x tiles (partials and residual) from L2: (split + 1) x K x rows
values per program. That is cheap at a row or two (the steps the chain sends here) and grows
with the rows, so the chain keeps the separate norm for larger steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tensor_checks
from kernels.gemv import MAX_BATCH, WEIGHT_DTYPES, GemvConfig
from kernels.rmsnorm import check_norm_inputs
from kernels.tensor_checks import (
    check_tensor,
    interpreting,
    pdl_launch,
    sm_count,
    supports_pdl,
)

# Split-1 tiles for the Llama-3-8B shapes that take a norm (qkv, gate_up); others: `_config`.
H200_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    (6144, 4096): GemvConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=4),
    (28672, 4096): GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3),
}


@triton.jit
def _gemv_norm_in_kernel(
    part_ptr,
    residual_ptr,
    norm_weight_ptr,
    w_ptr,
    out_ptr,
    stream_ptr,
    M,
    N,
    K,
    eps,
    stride_r,
    stride_wn,
    stride_om,
    stride_s,
    SPLIT_IN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # in the decode step's PDL chain: predecessor first, then ours
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    dtype = stream_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_valid = offs_n < N
    m_valid = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    sum_sq = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)  # reduced over K after the loop
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        if EVEN_K and EVEN_N:  # unmasked: 16-byte loads (a mask along K splits them)
            w = tl.load(w_rows + offs_k[None, :])
        elif EVEN_N:
            w = tl.load(w_rows + offs_k[None, :], mask=k_valid[None, :], other=0.0)
        else:
            w = tl.load(
                w_rows + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0
            )
        if EVEN_K:
            x_mask = tl.broadcast_to(m_valid[None, :], (BLOCK_K, BLOCK_M))
        else:
            x_mask = m_valid[None, :] & k_valid[:, None]
        stream = _stream_tile(
            part_ptr, residual_ptr, offs_m, offs_k, x_mask, M, K, stride_r, SPLIT_IN, dtype
        ).to(tl.float32)
        sum_sq += stream * stream
        if EVEN_K:
            nw = tl.load(norm_weight_ptr + offs_k).to(tl.float32)
        else:
            nw = tl.load(norm_weight_ptr + offs_k, mask=k_valid, other=0.0).to(tl.float32)
        x = (stream * nw[:, None]).to(dtype)
        if FP32_DOT:
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w, x)
    acc = acc * tl.math.rsqrt(tl.sum(sum_sq, 0) / K + eps)[None, :]
    tl.store(
        out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
        acc.to(out_ptr.dtype.element_ty),
        mask=n_valid[:, None] & m_valid[None, :],
    )
    # The new stream, a K-tile per program after the loop (a store inside the loop would keep
    # the next K-step's loads from being issued ahead of it: no pipelining).
    for tile in range(pid_n, tl.cdiv(K, BLOCK_K), tl.num_programs(0)):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x_mask = m_valid[None, :] & (offs_k < K)[:, None]
        stream = _stream_tile(
            part_ptr, residual_ptr, offs_m, offs_k, x_mask, M, K, stride_r, SPLIT_IN, dtype
        )
        tl.store(stream_ptr + offs_m[None, :] * stride_s + offs_k[:, None], stream, mask=x_mask)


@triton.jit
def _stream_tile(
    part_ptr, residual_ptr, offs_m, offs_k, x_mask, M, K, stride_r,
    SPLIT_IN: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    """The stream's tile [BLOCK_K, BLOCK_M] (transposed): the partials summed in the reduce
    kernel's order and rounded, plus the residual, rounded (add_rmsnorm_row's order)."""
    cols = offs_m[None, :] * K + offs_k[:, None]
    summed = tl.zeros(cols.shape, tl.float32)
    for s in tl.static_range(SPLIT_IN):
        summed += tl.load(part_ptr + s * M * K + cols, mask=x_mask, other=0.0)
    r = tl.load(residual_ptr + offs_m[None, :] * stride_r + offs_k[:, None], mask=x_mask, other=0.0)
    return (summed.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)


def _config(n: int, k: int, num_sms: int) -> GemvConfig:
    """Split-1 tiles: the known shape's, else the widest tile (64..16 rows) that still gives
    about one program per SM."""
    known = H200_CONFIGS.get((n, k))
    if known is not None:
        return known
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < 0.9 * num_sms:
        block_n //= 2
    return GemvConfig(block_n=block_n, block_k=128, split_k=1)


def gemv_rmsnorm_in(
    partials: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    fp32_out: bool = False,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stream) for rows of the previous projection's fp32 split-K partials [S, M, K]
    (`kernels.gemv.gemv_partials`) and the residual stream [M, K] (M <= 16):

        stream = dtype(dtype(sum of the partials) + residual)      (as gemv_add_rmsnorm)
        y      = rmsnorm(stream) * norm_weight @ weight^T           ([M, N], dtype)

    fp32_out: y as the fp32 [1, M, N] "partials" of a split-1 product, for a kernel that reads
    partials (kernels/decode_from_qkv.py). `config` must have split_k 1 (every program walks
    the whole row: it needs the row's sum of squares)."""
    part = check_tensor("partials", partials, dtypes=(torch.float32,), ndim=3, contiguous=True)
    split_in, m, k = part.shape
    weight = check_tensor(
        "weight", weight, dtypes=WEIGHT_DTYPES, ndim=2, device=part.device,
        last_dim_contiguous=True,
    )  # fmt: skip
    checked, norm_weight = check_norm_inputs(weight, (m, k), norm_weight, eps, residual)
    assert checked is not None
    residual = checked
    if weight.shape[1] != k:
        raise ValueError(f"weight is [N, K] = {tuple(weight.shape)} but the partials have K = {k}")
    if not 1 <= m <= MAX_BATCH:
        raise ValueError(f"gemv takes 1..{MAX_BATCH} rows, got {m}; use a GEMM for more")
    if split_in < 1 or weight.shape[0] == 0 or k == 0:
        raise ValueError(f"empty product: partials {tuple(part.shape)}, weight {weight.shape}")
    n = weight.shape[0]
    cfg = config or _config(n, k, sm_count(part.device))
    if cfg.split_k != 1 or cfg.block_k < 16 or cfg.block_n < 16:
        raise ValueError(f"gemv_rmsnorm_in needs split_k 1 and tiles >= 16, got {cfg}")
    if interpreting():
        cfg = GemvConfig(cfg.block_n, min(cfg.block_k, 64), 1, cfg.num_warps, 1)
    use_pdl = supports_pdl(part.device) and (
        tensor_checks.CHAIN_PDL_DEFAULT if pdl is None else pdl
    )
    dtype = weight.dtype
    out = torch.empty(
        *((1, m, n) if fp32_out else (m, n)),
        dtype=torch.float32 if fp32_out else dtype,
        device=part.device,
    )
    stream = torch.empty(m, k, dtype=dtype, device=part.device)
    _gemv_norm_in_kernel[(triton.cdiv(n, cfg.block_n),)](
        part, residual, norm_weight, weight, out, stream, m, n, k, float(eps),
        residual.stride(0), weight.stride(0), n, stream.stride(0),
        SPLIT_IN=split_in, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        FP32_DOT=interpreting() or dtype == torch.float32,
        PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(use_pdl),
    )  # fmt: skip
    return out, stream


def gemv_rmsnorm_in_reference(
    partials: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference: (y in fp32, stream rounded as the kernel rounds it)."""
    dtype = residual.dtype
    stream = (partials.sum(0).to(dtype).float() + residual.float()).to(dtype)
    s = stream.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return normed @ weight.float().t(), stream
