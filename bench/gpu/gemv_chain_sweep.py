"""GEMV tile configs swept inside the decode chain, not in isolation.

Each candidate config of one Llama-3-8B projection (the others at the launcher's choice) is
captured in a 32-layer fused chain (bench/gpu/pdl_chain.py `fused_step`, 15 GB of weights, one
CUDA graph) and replayed alternately with the baseline graph; a candidate's score is its median
chain time minus the baseline's from the same rounds. In a chain a GEMV's ramp-up and tail
overlap its neighbours' (PDL), which isolated timings (kernels_h200.md) do not see.

    python3 bench/gpu/gemv_chain_sweep.py [--rows 1] [--replays 7]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.gpu.graph_replays import captured
from bench.gpu.pdl_chain import HIDDEN, fused_step, layer_weights
from kernels.decode_chain.gemv import GemvConfig

C = GemvConfig
CANDIDATES: dict[str, list[GemvConfig]] = {
    "qkv": [
        C(64, 128, 1),
        C(32, 128, 1),
        C(32, 128, 2),
        C(64, 128, 4),
        C(64, 128, 2, num_stages=6),
        C(128, 128, 2, num_warps=8, num_stages=3),
        C(64, 256, 2, num_stages=3),
    ],
    "o": [
        C(32, 128, 1),
        C(32, 128, 2),
        C(64, 128, 4),
        C(32, 128, 4),
        C(64, 128, 2, num_stages=6),
        C(64, 256, 2, num_stages=3),
    ],
    # 28672 x 4096 at the launcher's (64, 128, split 1, 4 stages) is 448 programs: more than
    # fit at once (smem), so a second, partial wave streams at a fraction of the bandwidth.
    "gate_up": [
        C(64, 128, 1, num_stages=3),
        C(64, 128, 1, num_stages=2),
        C(128, 128, 1, num_stages=3),
        C(128, 128, 1, num_stages=2),
        C(128, 128, 1, num_warps=8, num_stages=3),
        C(128, 64, 1),
        C(128, 64, 1, num_stages=6),
        C(256, 64, 1, num_warps=8),
        C(128, 128, 1),
        C(64, 128, 2),
    ],
    "down": [
        C(64, 128, 2),
        C(32, 128, 4),
        C(64, 128, 8),
        C(64, 128, 4, num_stages=6),
        C(128, 128, 4, num_stages=3),
        C(64, 256, 4, num_stages=3),
    ],
}


# Deeper pipelines that keep every program resident at once (one wave), --deep: the guess that
# the bytes each program has in flight limit the launcher's configs (down at split 2, half the
# programs, is +672 us a step above). Measured on the H200 and refuted: every one of these is
# slower in the chain, at 1 and 16 rows (bench/gpu/gemv_deep_h200.log).
DEEP_CANDIDATES: dict[str, list[GemvConfig]] = {
    "qkv": [
        C(64, 128, 2, num_stages=5),
        C(64, 256, 1, num_stages=4),
        C(64, 256, 1, num_stages=5),
        C(64, 128, 1, num_stages=8),
        C(128, 128, 2, num_stages=5),
        C(128, 128, 2, num_warps=8, num_stages=5),
    ],
    "o": [
        C(64, 256, 2, num_stages=4),
        C(64, 256, 2, num_stages=5),
        C(64, 128, 2, num_stages=8),
        C(64, 128, 2, num_stages=10),
        C(128, 128, 4, num_stages=5),
        C(128, 128, 4, num_warps=8, num_stages=5),
    ],
    "gate_up": [
        C(256, 64, 1, num_warps=8, num_stages=6),
        C(256, 128, 1, num_warps=8, num_stages=3),
        C(128, 64, 1, num_warps=4, num_stages=5),
    ],
    "down": [
        C(64, 128, 4, num_stages=5),
        C(64, 256, 2, num_stages=4),
        C(64, 256, 2, num_stages=5),
        C(64, 128, 2, num_stages=8),
        C(128, 128, 4, num_stages=5),
        C(128, 128, 4, num_warps=8, num_stages=5),
    ],
}


def capture(x: torch.Tensor, weights, configs) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    return captured(lambda: fused_step(x, weights, True, configs))


def timed(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--shapes", nargs="+", default=None)
    p.add_argument("--deep", action="store_true", help="the deeper one-wave pipelines")
    args = p.parse_args()
    candidates = DEEP_CANDIDATES if args.deep else CANDIDATES
    torch.manual_seed(0)
    weights = layer_weights(32)
    x = torch.randn(args.rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    base = capture(x, weights, None)
    for name in args.shapes or list(candidates):
        for cfg in candidates[name]:
            try:
                graph = capture(x, weights, {name: cfg})
            except Exception as exc:  # over the shared-memory limit
                print(f"rows {args.rows} {name:8s} {cfg}: failed, {type(exc).__name__}")
                continue
            ours, theirs = [], []
            for r in range(args.replays):
                pair = [(graph, ours), (base, theirs)]
                for g, out in pair if r % 2 else pair[::-1]:
                    out.append(timed(g))
            a, b = statistics.median(ours), statistics.median(theirs)
            print(
                f"rows {args.rows} {name:8s} {cfg}: {a:7.1f} us vs default {b:7.1f} "
                f"({a - b:+6.1f} us a step)",
                flush=True,
            )
            del graph


if __name__ == "__main__":
    main()
