"""(The 17..64-row GEMV this measured was removed after it: bench/gpu/skinny_gemm_h200.log;
kernels/decode_chain/gemv.py takes 1..16 rows again, so this runs only against a tree that has it back.)

The Triton GEMV at 17..64 rows against cuBLAS, at the Llama-3-8B decode shapes (H200).

Above 16 rows the worker has run every linear through cuBLAS (torch.matmul), which streams
the weights at ~3.5 TB/s at batch 64 (bench/gpu/step_trace_h200.log) where the GEMV reaches
~4.1 at batch 1. This sweeps the GEMV's tiles at 32 and 64 rows for each projection, keeps
the config with the least summed time, then times it against cuBLAS at 17, 24, 32, 48 and 64
rows. Times are CUDA-graph replays over rotated weight copies (HBM, not L2), as
kernel_timings.graph_ms does. The down projection is timed gated, as the worker runs it:
the GEMV with SiLU-and-multiply in its loads against kernels.layers.silu_mul then cuBLAS.

    python3 -m bench.gpu.skinny_gemm_sweep [--table FILE]

--table writes the winning configs as the body of kernels/decode_chain/gemv.py's H200_WIDE_CONFIGS;
--apply also writes them into this tree's kernels/decode_chain/gemv.py (for an A/B later in the same call).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.kernel_timings import copies_for, graph_ms
from kernels.decode_chain.gemv import GemvConfig, gemv
from kernels.layers.silu_mul import silu_mul

# (N, K), gated, per layer: fused qkv, o, fused gate_up, down (gated); the LM head once.
SHAPES: list[tuple[str, int, int, bool, int]] = [
    ("qkv", 6144, 4096, False, 32),
    ("o", 4096, 4096, False, 32),
    ("gate_up", 28672, 4096, False, 32),
    ("down", 4096, 14336, True, 32),
    ("lm_head", 128256, 4096, False, 1),
]
TILES = [  # block_n, block_k, num_warps, num_stages
    (64, 128, 4, 4),
    (128, 128, 4, 3),
    (128, 128, 4, 4),
    (128, 64, 4, 4),
    (128, 64, 4, 6),
    (128, 128, 8, 4),
    (256, 64, 8, 3),
    (64, 64, 4, 6),
]
SWEEP_ROWS = (32, 64)
REPORT_ROWS = (16, 17, 24, 32, 48, 64)


def candidates(n: int, k: int) -> list[GemvConfig]:
    out = []
    for bn, bk, nw, ns in TILES:
        tiles = -(-n // bn)
        for split in (1, 2, 4, 8):
            if k // (bk * split) < 4 or (split > 1 and tiles * split > 4 * 132):
                continue
            out.append(GemvConfig(bn, bk, split, nw, ns))
    return out


def calls_for(
    n: int, k: int, gated: bool, rows: int, cfg: GemvConfig | None, weights: list[torch.Tensor]
) -> list[Callable[[], Any]]:
    """One call per weight copy: the GEMV at `cfg`, or cuBLAS when cfg is None."""
    x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    if cfg is None:
        if gated:
            return [lambda w=w: torch.matmul(silu_mul(x), w.t()) for w in weights]
        return [lambda w=w: torch.matmul(x, w.t()) for w in weights]
    return [lambda w=w: gemv(x, w, cfg, gated=gated) for w in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--table", default="", help="write the H200_WIDE_CONFIGS body here")
    parser.add_argument("--apply", action="store_true", help="write the table into gemv.py")
    parser.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    args = parser.parse_args()
    step = {rows: {"triton": 0.0, "cublas": 0.0} for rows in REPORT_ROWS}
    table = []
    for name, n, k, gated, per_step in SHAPES:
        if name not in args.shapes:
            continue
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(copies_for(n * k * 2))
        ]
        scored = []
        for cfg in candidates(n, k):
            try:
                us = [1e3 * graph_ms(calls_for(n, k, gated, r, cfg, weights)) for r in SWEEP_ROWS]
            except Exception as exc:  # a config the compiler rejects is skipped
                print(f"{name} {cfg} failed: {exc!r}"[:200])
                continue
            scored.append((sum(us), us, cfg))
        scored.sort(key=lambda t: t[0])
        best = scored[0][2]
        print(f"{name} {n}x{k}{' gated' if gated else ''}: top 4 of {len(scored)} (us at 32, 64)")
        for _, us, cfg in scored[:4]:
            print(f"    {cfg}  " + " ".join(f"{u:.1f}" for u in us))
        table.append(f"    ({n}, {k}): {best!r},")
        for rows in REPORT_ROWS:
            ours = 1e3 * graph_ms(calls_for(n, k, gated, rows, best, weights))
            cublas = 1e3 * graph_ms(calls_for(n, k, gated, rows, None, weights))
            tbs = n * k * 2 / ours / 1e6
            print(
                f"  rows {rows:2d}: gemv {ours:7.1f} us ({tbs:.2f} TB/s)  cuBLAS {cublas:7.1f} us"
                f"  ratio {cublas / ours:.3f}"
            )
            step[rows]["triton"] += per_step * ours
            step[rows]["cublas"] += per_step * cublas
        del weights
        torch.cuda.empty_cache()
    print("weights of one decode step (32 layers + LM head, sum of graph times):")
    for rows, t in step.items():
        if t["cublas"]:
            print(
                f"  rows {rows:2d}: gemv {t['triton'] / 1e3:.3f} ms  cuBLAS {t['cublas'] / 1e3:.3f}"
                f" ms  ratio {t['cublas'] / t['triton']:.3f}"
            )
    body = "\n".join(table) + "\n"
    if args.table:
        with open(args.table, "w") as f:
            f.write(body)
    if args.apply:
        apply_table(body)


def apply_table(body: str, path: str = "kernels/decode_chain/gemv.py") -> None:
    """Replace the entries of H200_WIDE_CONFIGS in `path` with `body`."""
    with open(path) as f:
        source = f.read()
    head = "H200_WIDE_CONFIGS: dict[tuple[int, int], GemvConfig] = {"
    pattern = re.compile(re.escape(head) + r".*?\n?}\n", re.S)
    source, count = pattern.subn(lambda _: head + "\n" + body + "}\n", source, count=1)
    if count != 1:
        raise SystemExit(f"H200_WIDE_CONFIGS not found in {path}")
    with open(path, "w") as f:
        f.write(source)


if __name__ == "__main__":
    main()
