"""What a launch boundary costs a chain of batch-1 GEMVs, and what a persistent kernel saves.

A chain of `--layers` dependent products y_{l+1} = W_l y_l (one row, 4096 x 4096 bf16 weights
each, 33.5 MB, all distinct so every product streams from HBM), three ways, each captured in a
CUDA graph and timed by its replays:

- "launches": one `kernels.decode_chain.gemv.gemv` launch per product (the decode chain's GEMV, in its PDL
  chain: the split-K product and its reduce);
- "persistent": one grid of one program per SM for the whole chain. Each program takes its
  tiles of rows of product l, waits (an acquire spin on a per-product counter) until every
  tile of product l - 1 is stored, streams its weights and stores its rows, then counts its
  tile done (release);
- "persistent+early": the same, but each program loads its first weight block of product l
  before it waits: the weights never depend on the previous product, so their first bytes
  are in flight while the last tiles of l - 1 finish.

The first is what the decode step does 128 times a step; the gap between it and the others
is the ramp and tail a launch boundary costs (README, issue #9's batch-1 target). Outputs are
checked against an fp32 chain.

    python3 -m bench.gpu.persistent_chain [--layers 64] [--replays 9] [--block-k 256] [--stages 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

from bench.gpu.graph_replays import rotating_replays
from kernels.decode_chain.gemv import gemv
from kernels.runtime.tensor_checks import sm_count

HIDDEN = 4096


@triton.jit
def _persistent_chain_kernel(
    w_ptr,
    act_ptr,
    done_ptr,
    LAYERS: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EARLY: tl.constexpr,
):
    """act [LAYERS + 1, HIDDEN] bf16 (row 0 the input); done [LAYERS] int32 zeroed. The
    product runs on the tensor cores as the GEMV's does: W_tile @ x^T with the one row padded
    to 16 columns."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = HIDDEN // BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, 16)
    x_mask = (offs_m < 1)[None, :] & (offs_k >= 0)[:, None]
    for layer in range(LAYERS):
        for tile in range(pid, tiles, programs):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = w_ptr + (layer * HIDDEN + offs_n).to(tl.int64)[:, None] * HIDDEN
            if EARLY:  # the first weight block is in flight before the wait
                w0 = tl.load(rows + offs_k[None, :])
            if layer > 0:
                while tl.atomic_add(done_ptr + layer - 1, 0, sem="acquire") < tiles:
                    pass
                tl.debug_barrier()
            x_cols = act_ptr + layer * HIDDEN + offs_k[:, None] + offs_m[None, :] * 0
            acc = tl.zeros([BLOCK_N, 16], tl.float32)
            start = 0
            if EARLY:
                x0 = tl.load(x_cols, mask=x_mask, other=0.0, cache_modifier=".cg")
                acc += tl.dot(w0, x0)
                start = BLOCK_K
            for k in range(start, HIDDEN, BLOCK_K):
                w = tl.load(rows + k + offs_k[None, :])
                x = tl.load(x_cols + k, mask=x_mask, other=0.0, cache_modifier=".cg")
                acc += tl.dot(w, x)
            y = tl.sum(tl.where((offs_m == 0)[None, :], acc, 0.0), 1)
            tl.store(act_ptr + (layer + 1) * HIDDEN + offs_n, y.to(tl.bfloat16))
            tl.debug_barrier()  # every thread's rows stored before the release
            tl.atomic_add(done_ptr + layer, 1, sem="release")


def persistent_chain(
    weights: torch.Tensor,
    act: torch.Tensor,
    done: torch.Tensor,
    early: bool,
    block_k: int,
    stages: int,
) -> torch.Tensor:
    """Run the chain over weights [L, H, H] from act[0]; returns act[L] (bf16)."""
    layers = weights.shape[0]
    done.zero_()
    _persistent_chain_kernel[(sm_count(weights.device),)](
        weights, act, done, LAYERS=layers, HIDDEN=HIDDEN, BLOCK_N=32, BLOCK_K=block_k,
        EARLY=early, num_warps=4, num_stages=stages,
    )  # fmt: skip
    return act[layers]


def launches_chain(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    for w in weights:
        x = gemv(x, w)
    return x


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--replays", type=int, default=9)
    p.add_argument("--block-k", type=int, default=256, help="persistent kernel's K-step")
    p.add_argument("--stages", type=int, default=4, help="persistent kernel's pipeline depth")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = torch.randn(args.layers, HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16)
    weights /= HIDDEN**0.5
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    act = torch.zeros(args.layers + 1, HIDDEN, device=dev, dtype=torch.bfloat16)
    act[0] = x[0]
    done = torch.zeros(args.layers, device=dev, dtype=torch.int32)
    modes = {
        "launches": lambda: launches_chain(weights, x),
        "persistent": lambda: persistent_chain(
            weights, act, done, False, args.block_k, args.stages
        ),
        "persistent+early": lambda: persistent_chain(
            weights, act, done, True, args.block_k, args.stages
        ),
    }
    graphs, outputs = {}, {}
    for name, fn in modes.items():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs[name] = fn()
        graphs[name] = graph
    ref = x.float()
    for w in weights:
        ref = (ref @ w.float().t()).to(torch.bfloat16).float()
    times = rotating_replays(graphs, args.replays)
    gigabytes = weights.numel() * 2 / 1e9
    base = statistics.median(times["launches"])
    for name in modes:
        med = statistics.median(times[name])
        out = outputs[name].float().reshape(-1)
        error = float((out - ref.reshape(-1)).norm() / ref.norm())
        print(
            f"{name:17s}: {med:8.1f} us for {args.layers} products ({gigabytes / med * 1e3:5.2f} "
            f"TB/s, {(base - med) / args.layers:+5.2f} us a product vs launches); rel. error "
            f"vs fp32 chain {error:.2e}; replays {sorted(round(t) for t in times[name])}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
