"""The norm-in GEMV (kernels/gemv_norm_in.py) alone at the Llama-3-8B qkv and gate_up shapes,
one row, against the plain GEMV, across tile configs,
stage counts and the split count of its input partials.

Each case is 32 launches with their own weights (so every product streams from HBM) captured
in one CUDA graph; the median of the replays, per launch.

    python3 -m bench.gpu.norm_in_sweep
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch

from kernels.gemv import GemvConfig, gemv, gemv_partials
from kernels.gemv_norm_in import gemv_rmsnorm_in

HIDDEN, COPIES, REPLAYS = 4096, 32, 7


def graph_us(fn: Callable[[int], object]) -> float:
    """Median replay time per launch of fn(0..COPIES-1) captured in one graph."""
    for i in range(COPIES):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(COPIES):
            fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / COPIES)
    return statistics.median(times)


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    norm_w = torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)
    prev_w = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) / 64
    for n in (6144, 28672):
        weights = [
            torch.randn(n, HIDDEN, device=dev, dtype=torch.bfloat16) / 64 for _ in range(COPIES)
        ]
        gb = n * HIDDEN * 2 / 1e3  # bytes per launch / 1e3 -> GB/s when divided by us
        base = graph_us(lambda i, w=weights: gemv(x, w[i]))
        print(f"N={n}: gemv alone {base:7.1f} us ({gb / base:6.0f} GB/s)", flush=True)
        for block_n in (32, 64, 128):
            for stages in (1, 3):
                cfg = GemvConfig(block_n, 128, 1, 4, stages)
                plain = graph_us(lambda i, c=cfg, w=weights: gemv(x, w[i], c))
                line = f"  block_n {block_n:3d} stages {stages}: gemv {plain:6.1f} us"
                for split in (1, 4):
                    part = gemv_partials(x, prev_w, GemvConfig(64, 128, split))
                    us = graph_us(
                        lambda i, p=part, c=cfg, w=weights: gemv_rmsnorm_in(
                            p, residual, norm_w, 1e-5, w[i], c
                        )
                    )
                    line += f" | norm-in (split_in {split}) {us:6.1f} us ({gb / us:5.0f} GB/s)"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
