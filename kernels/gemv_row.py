"""The one-row decode GEMV on CUDA cores: y[1, N] = x[1, K] @ W[N, K]^T, fp32 accumulation.

At one row the tensor-core kernel of kernels/gemv.py pads the row to 16 columns and stages every
weight tile through shared memory for the matrix unit. This kernel loads [BLOCK_N, BLOCK_K]
weight tiles straight into registers (16-byte loads along K), multiplies them by x in fp32 into
a [BLOCK_N, BLOCK_K] accumulator and sums along K once, after the loop. Small row tiles give
many programs, so the weight streams of all SMs end close together.

H200, one row, 32 launches with their own weights in a CUDA graph, PDL on as in the decode
chain (bench/gpu/gemv_b1_variants.py, bench/gpu/gemv_b1_h200.log): qkv 6144 x 4096 13.4 us vs
16.1 with the tensor-core kernel, gate_up 28672 x 4096 55.5 vs 61.4; no gain at the o and down
shapes (9.6 vs 9.7, 28.6 vs 28.6), which keep the tensor-core kernel. Shapes not in
H200_ROW_CONFIGS keep it too.

The output is the same product in another summation order: fp32 split-K partials [split, 1, N]
or the product in x's dtype, exactly as kernels/gemv.py lays them out, so every consumer of its
partials (the split-K reduce, the residual-add + RMSNorm, the fused decode attention) takes
them unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The one-row configs of the H200 sweep (bench/gpu/gemv_b1_variants.py), as (block_n, block_k,
# split_k, num_warps): the Llama-3-8B fused qkv and gate_up shapes (N, K).
H200_ROW_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (32, 256, 2, 8),
    (28672, 4096): (8, 512, 1, 4),
}
# On by default; False keeps every one-row product on the tensor-core kernel (A/B runs).
ROW_GEMV_DEFAULT = True


@triton.jit
def gemv_row_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    k_per_split,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PARTIALS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (pid_n, pid_k): rows [pid_n * BLOCK_N, +BLOCK_N) over K range pid_k; stores
    fp32 partials at out_ptr[pid_k, 0, n] (USE_PARTIALS) or the product at out_ptr[0, n]."""
    if PDL:  # in the decode step's PDL chain: predecessor first, then ours
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K and EVEN_N:
            w = tl.load(w_rows + offs_k[None, :])
            x = tl.load(x_ptr + offs_k)
        else:
            k_valid = offs_k < k_end
            w = tl.load(
                w_rows + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0
            )
            x = tl.load(x_ptr + offs_k, mask=k_valid, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if USE_PARTIALS:
        tl.store(out_ptr + pid_k.to(tl.int64) * N + offs_n, y, mask=n_valid)
    else:
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_valid)
