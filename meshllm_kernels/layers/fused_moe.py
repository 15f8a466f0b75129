"""Fused MoE: out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) with SwiGLU experts, and
its PyTorch reference.

Layout (services/worker/models/moe.py): w13 [E, 2I, H] (rows [gate; up]), w2 [E, H, I].

The (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M (`align_pairs`, on the device into a static worst-case size, so CUDA graphs capture MoE
layers), so every BLOCK_M rows of the sorted order belong to ONE expert. One
grouped-GEMM kernel then serves both projections: a program takes a BLOCK_M x BLOCK_N tile,
loads its expert's weight tile once and its rows' activations by index (tokens for the first
GEMM, pairs for the second), so no activation is copied into expert order. The second GEMM
multiplies each row by its routing weight; the k rows of a token are summed at the end in a
fixed order (deterministic, no atomics). Padding rows carry the pair index `num_pairs` and are
masked out of every load and store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from meshllm_kernels.runtime.tensor_checks import (
    INDEX_DTYPES,
    MODEL_DTYPES,
    check_tensor,
    interpreting,
)

BLOCK_M = 16


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weight_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    top_k,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the last expert's run (align_pairs' static size): nothing to do
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    if A_PER_TOKEN:  # noqa: SIM108 (a constexpr branch: one of them is compiled)
        a_row = pair // top_k
    else:
        a_row = pair
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        if FP32_DOT:
            # ieee: on a GPU an fp32 tl.dot defaults to TF32 (10-bit mantissa, ~1e-2 error)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=valid, other=0.0)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < N),
    )


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair indices [M] int32 padded with T*k, expert of each BLOCK_M block [M/BLOCK_M]
    int32, -1 for a block past the last expert's run).

    Pair p = t * k + slot. Each expert's pairs are contiguous and its run is padded up to a
    multiple of block_m, so a block never mixes experts. Computed on the device only, into the
    static worst-case size M = roundup(T*k + E * (block_m - 1), block_m) (vLLM's
    moe_align_block_size bound): no host read of the per-expert counts, so a CUDA graph can
    capture it; the kernel ends a block of expert -1 at once.
    """
    flat = ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    run_start = run_end - padded
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    size = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[run_start[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(run_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert.to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None,
) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n = 32 if n >= 32 else 16
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        sorted_ids,
        block_expert,
        out.shape[0],
        n,
        k,
        top_k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=32,
        A_PER_TOKEN=weights is None,
        MUL_WEIGHT=weights is not None,
        # fp32 weights get an exact fp32 product (not TF32); the interpreter needs fp32 for bf16
        FP32_DOT=interpreting() or a.dtype == torch.float32,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; weights [T, k] float; ids [T, k] -> [T, H]."""
    x = check_tensor("x", x, dtypes=MODEL_DTYPES, ndim=2, contiguous=True)
    device = x.device
    w13 = check_tensor("w13", w13, dtypes=(x.dtype,), ndim=3, device=device, contiguous=True)
    w2 = check_tensor("w2", w2, dtypes=(x.dtype,), ndim=3, device=device, contiguous=True)
    weights = check_tensor("weights", weights, dtypes=MODEL_DTYPES, ndim=2, device=device)
    ids = check_tensor("ids", ids, dtypes=INDEX_DTYPES, ndim=2, device=device)
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden or two_inter % 2:
        raise ValueError(f"w13 must be [E, 2I, {hidden}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"w2 must be [{experts}, {hidden}, {inter}], got {tuple(w2.shape)}")
    if ids.shape[0] != tokens or weights.shape != ids.shape:
        raise ValueError(
            f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [{tokens}, k]"
        )
    top_k = ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    if top_k < 1 or top_k > experts:
        raise ValueError(f"expert ids must be in [0, {experts}) with 1 <= k <= {experts}")
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and (int(ids.min()) < 0 or int(ids.max()) >= experts):  # a host read:
        # checked outside CUDA graph captures (the router's top-k cannot leave the range)
        raise ValueError(f"expert ids must be in [0, {experts}) with 1 <= k <= {experts}")
    sorted_ids, block_expert = align_pairs(ids, experts)
    num_pairs = tokens * top_k
    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, top_k, None)
    gate, up = gate_up.split(inter, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=device)
    pair_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, out, sorted_ids, block_expert, top_k, pair_weights)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The same sum, each (token, slot) pair computed on its own in fp32."""
    inter = w2.shape[-1]
    xf = x.float()
    gate_up = torch.einsum("th,tkoh->tko", xf, w13.float()[ids.long()])
    gate, up = gate_up.split(inter, dim=-1)
    down = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2.float()[ids.long()])
    return (down * weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)
