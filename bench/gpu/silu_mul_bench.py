"""The gated MLP's SiLU-and-multiply: eager `F.silu(gate) * up` (two launches over strided
halves) against kernels/layers/silu_mul.py (one), Llama-3-8B width (intermediate 14336), bf16, at the
decode batches and the prefill step size of bench/gpu/decode_e2e.py. Each op is timed inside
a CUDA graph (20 launches, as back to back as in the worker's decode graphs), CUDA events,
median.
GB/s counts the bytes the fused kernel must move (read [T, 2D], write [T, D]).

    python3 -m bench.gpu.silu_mul_bench            # on the H200
"""

from __future__ import annotations

import argparse

import torch

from bench.gpu.decode_e2e import gpu_ms, graphed
from kernels.layers.silu_mul import silu_mul, silu_mul_reference

REPEATS = 20  # launches of the op per graph, the time divided by them


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256, 8192])
    p.add_argument("--width", type=int, default=14336)
    args = p.parse_args()
    head = ("rows", "eager us", "fused us", "speedup", "fused GB/s", "equal")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 9, 9, 8, 11, 6), strict=True)))
    for rows in args.rows:
        x = torch.randn(rows, 2 * args.width, device="cuda", dtype=torch.bfloat16)
        eager_ms = gpu_ms(graphed(lambda x=x: [silu_mul_reference(x) for _ in range(REPEATS)]))
        fused_ms = gpu_ms(graphed(lambda x=x: [silu_mul(x) for _ in range(REPEATS)]))
        eager_ms, fused_ms = eager_ms / REPEATS, fused_ms / REPEATS
        moved = 3 * rows * args.width * x.element_size()
        equal = torch.equal(silu_mul(x), silu_mul_reference(x))
        print(
            f"{rows:>6} {eager_ms * 1000:>9.1f} {fused_ms * 1000:>9.1f} "
            f"{eager_ms / fused_ms:>7.2f}x {moved / fused_ms / 1e6:>11.0f} {equal!s:>6}"
        )


if __name__ == "__main__":
    main()
