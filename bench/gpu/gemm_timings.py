"""The TMA GEMM (meshllm_kernels/layers/gemm_tma.py) against cuBLAS at a Llama-3-8B layer's
weight shapes, at decode batch rows (64, 128, 256) and one prefill chunk (8,192 rows).

For gate_up the baseline is what the worker runs: cuBLAS's [T, 2D] product, then the
SiLU-and-multiply kernel; the TMA GEMM's gated form does both in one launch. Each Triton row is
the best of a config sweep (block shape, pipeline depth, warp specialization); every config's
output is checked against the baseline's before it is timed (relative error; a config over
REL_TOL is reported and not timed). Times are per call in a CUDA graph, weights rotated across
copies that together exceed L2 (bench/gpu/graph_timing.py).

    python3 -m bench.gpu.gemm_timings --out $OUT/gemm.json [--rows 64 256] [--shapes gate_up]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu.graph_timing import Report, copies_for, graph_ms
from meshllm_kernels.layers.gemm_tma import GemmConfig, gemm
from meshllm_kernels.layers.silu_mul import silu_mul

# name: (N, K, gated) of a Llama-3-8B layer's weights (gate_up: N = 2 x 14336).
SHAPES = {
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, True),
    "down": (4096, 14336, False),
}
ROWS = (64, 128, 256, 8192)
REL_TOL = 2e-2


def candidates(m: int, k: int, gated: bool) -> list[GemmConfig]:
    """Prefill rows: large tiles, whole K. Decode rows (memory-bound): also deeper pipelines,
    128-wide K steps and split-K, since a few dozen output tiles alone leave SMs idle."""
    if m > 256 or gated:
        block_ms = (128,) if m > 256 else (64, 128)
        block_ns = (64, 128) if gated else (64, 128, 256)
        return [
            GemmConfig(bm, bn, 64, 8, stages, 4 if bm == 64 else 8, ws)
            for bm in block_ms
            for bn in block_ns
            for stages in (3, 4)
            for ws in (False, True)
        ]
    block_ms = (64,) if m <= 64 else (64, 128)
    splits = (1, 2, 4, 8) if k > 8192 else (1, 2, 4)
    return [
        GemmConfig(bm, bn, bk, 8, stages, 4 if bm == 64 else 8, ws, split)
        for bm in block_ms
        for bn in (64, 128)
        for bk in (64, 128)
        for stages in (4, 6)
        for ws in (False, True)
        for split in splits
    ]


def baseline(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    y = F.linear(x, w)
    return silu_mul(y) if gated else y


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def time_shape(report: Report, name: str, m: int) -> dict[str, object]:
    n, k, gated = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    ws = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
        for _ in range(copies_for(n * k * 2))
    ]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = baseline(x, ws[0], gated)
    flops = 2 * m * n * k
    base_ms = graph_ms([lambda w=w: baseline(x, w, gated) for w in ws])
    sweep: list[tuple[float, GemmConfig]] = []
    for cfg in candidates(m, k, gated):
        try:
            err = rel_err(gemm(x, ws[0], cfg, gated=gated), ref)
            if err > REL_TOL:
                report.notes.append(f"gemm {name} M={m} {cfg}: rel err {err:.3g}, not timed")
                continue
            calls = [lambda w=w, c=cfg: gemm(x, w, c, gated=gated) for w in ws]
            sweep.append((graph_ms(calls), cfg))
        except Exception as exc:  # a config the compiler rejects (shared memory) is skipped
            report.notes.append(f"gemm {name} M={m} {cfg} failed: {exc!r}"[:300])
    if not sweep:
        raise RuntimeError(f"no TMA GEMM config ran for {name} M={m}")
    sweep.sort(key=lambda t: t[0])
    best_ms, best = sweep[0]
    report.timing(
        f"tma gemm {name}{' +silu' if gated else ''}", f"M={m} N={n} K={k}", best_ms,
        flops=flops, bytes_moved=(m * k + n * k + m * (n // 2 if gated else n)) * 2,
        baseline="cuBLAS" + (" + silu_mul" if gated else ""), baseline_ms=base_ms,
        config=str(best), top3=[f"{c} {t * 1e3:.1f}" for t, c in sweep[:3]],
    )  # fmt: skip
    return {"shape": name, "m": m, "triton_us": best_ms * 1e3, "cublas_us": base_ms * 1e3,
            "config": str(best)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemm_timings needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__}
    report = Report(env=env)
    rows: list[dict[str, object]] = []
    for name in args.shapes:
        for m in args.rows:
            with report.part(f"{name} M={m}"):
                rows.append(time_shape(report, name, m))
            torch.cuda.empty_cache()
    print("\n| shape | M | cuBLAS us | TMA GEMM us | cuBLAS / TMA | config |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        ratio = float(r["cublas_us"]) / float(r["triton_us"])  # type: ignore[arg-type]
        print(f"| {r['shape']} | {r['m']} | {r['cublas_us']:.1f} | {r['triton_us']:.1f} | "
              f"{ratio:.3f} | {r['config']} |")  # fmt: skip
    for note in report.notes:
        print("note:", note)
    if args.out:
        result = {"env": env, "rows": rows, "timings": report.timings, "notes": report.notes}
        args.out.write_text(json.dumps(result | {"failures": report.failures}, indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
