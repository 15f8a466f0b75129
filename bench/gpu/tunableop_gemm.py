"""cuBLAS as PyTorch calls it by default against PyTorch's TunableOp (every cuBLAS / cuBLASLt
algorithm for the shape benchmarked once, the fastest kept), at the Llama-3-8B linears'
shapes: decode steps of 64 and 256 rows (the mesh's batch-64 and -256 runs) and 8192-row
prefill steps (issue #9: the 10x targets at batch 64 and 256 are bound by these GEMMs).

Each shape is timed as CUDA-graph replays of `copies` launches with their own weights (so
weights stream from HBM as in a step), default and tuned graphs replayed in rotation.

    python3 -m bench.gpu.tunableop_gemm [--rows 64 256 8192]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.gpu.gemv_b1_variants import SHAPES
from bench.gpu.graph_replays import captured, rotating_replays

L2_BYTES = 60 << 20


def graph_of(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
    def run() -> None:
        for w in weights:
            F.linear(x, w)

    return captured(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 8192])
    parser.add_argument("--replays", type=int, default=11)
    parser.add_argument("--results", default="/tmp/tunableop_results.csv")
    args = parser.parse_args()
    tunable = torch.cuda.tunable
    tunable.set_filename(args.results)
    totals: dict[int, list[float]] = {m: [0.0, 0.0] for m in args.rows}
    for m in args.rows:
        for name, (n, k) in SHAPES.items():
            if m > 256 and name == "lm_head":  # prefill computes logits of last rows only
                continue
            copies = max(2, min(8, -(-4 * L2_BYTES // (n * k * 2))))
            weights = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
                for _ in range(copies)
            ]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tunable.enable(False)
            plain = graph_of(x, weights)
            ref = F.linear(x, weights[0])
            tunable.enable(True)
            tunable.tuning_enable(True)
            tunable.set_max_tuning_iterations(50)
            tuned_out = F.linear(x, weights[0])  # tunes this shape (eager, outside capture)
            torch.cuda.synchronize()
            tunable.tuning_enable(False)
            tuned = graph_of(x, weights)
            tunable.enable(False)
            err = float((tuned_out.float() - ref.float()).norm() / ref.float().norm())
            times = rotating_replays({"plain": plain, "tuned": tuned}, args.replays)
            a = statistics.median(times["plain"]) / copies
            b = statistics.median(times["tuned"]) / copies
            totals[m][0] += a
            totals[m][1] += b
            tb = n * k * 2 / 1e6
            flops = 2 * m * n * k / 1e6
            print(
                f"rows {m:5d} {name:8s}: cuBLAS {a:8.1f} us ({tb / a:4.2f} TB/s, "
                f"{flops / a:5.1f} TFLOP/s)  tuned {b:8.1f} us  ratio {a / b:5.3f}  "
                f"rel diff {err:.1e}",
                flush=True,
            )
            del weights, plain, tuned
            torch.cuda.empty_cache()
    for m, (a, b) in totals.items():
        print(
            f"rows {m:5d} sum of the shapes: cuBLAS {a:8.1f} us  tuned {b:8.1f} us  {a / b:5.3f}x"
        )
    print("tuned algorithms (op, shape, solution, ms):")
    for row in tunable.get_results():
        print("  ", row)


if __name__ == "__main__":
    main()
