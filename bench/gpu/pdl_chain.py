"""The decode step's RMSNorm / GEMV / split-K reduce kernels chained with programmatic dependent
launch (PDL, `tensor_checks.CHAIN_PDL_DEFAULT`) against the same launches without it.

One "layer" is the Triton part of a Llama-3-8B decode layer without attention: RMSNorm(+res),
qkv GEMV (+reduce), o GEMV (+reduce), RMSNorm(+res), gate_up GEMV, down GEMV with the SiLU fused
(+reduce): 9 launches. 32 layers with their own weights (15 GB, so every GEMV streams from HBM)
are captured in one CUDA graph per mode; the replays rotate through the modes, and the outputs of
all modes are compared (the chain only changes when launches start, not what they compute).
Mode "fused" is the decode chain of services/worker/accel/decode_chain.py: the o and down reduces
summed by the residual-add + RMSNorm kernel that follows them (7 launches a layer).

    python3 bench/gpu/pdl_chain.py [--rows 1 16] [--layers 32] [--replays 9]

H200, 2026-11-30 (bench/gpu/pdl_chain_h200.log, two device calls): 1 row 3787 -> 3699 us and
3708 -> 3640 us (1.02x, ~0.3 us a launch), 16 rows 3886 -> 3838 and 3837 -> 3795 (1.01x).
Tried with it and dropped: each GEMV prefetching its first 2 or 4 K-steps of weights into L2
(`prefetch.global.L2`) before waiting for its predecessor: 3707 / 3752 us at 1 row, 3824 / 3880
at 16 (no better than PDL alone, worse at 4).

H200, 2026-11-30 later (bench/gpu/decode_chain_h200.log, trigger_first_h200.log): "fused"
3679 / 3597 us vs "pdl" 3713 / 3637 at 1 row, 3803 / 3752 vs 3845 / 3822 at 16 (1.01-1.02x).
Tried and dropped: every chain kernel triggering its successor before waiting for its
predecessor (so the GEMV two launches ahead is resident, and can prefetch its first weight
tiles into L2, while the one before it streams its tail): 3865 us at 1 row (trigger first
only), 3931 (+4 K-steps of L2 prefetch), 4108 (+8), against 3597 for "fused" in the same run;
16 rows alike. Grids parked at their wait cost more than the ramps they were meant to hide.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.gpu.graph_replays import rotating_replays
from kernels.decode_chain.gemv import GemvConfig, gemv, gemv_add_rmsnorm
from kernels.layers.rmsnorm import rmsnorm

HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144


def layer_weights(layers: int) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5

    return [
        {
            "norm1": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
            "norm2": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
            "qkv": w(QKV, HIDDEN),
            "o": w(HIDDEN, HIDDEN),
            "gate_up": w(2 * INTERMEDIATE, HIDDEN),
            "down": w(HIDDEN, INTERMEDIATE),
        }
        for _ in range(layers)
    ]


def step(x: torch.Tensor, weights: list[dict[str, torch.Tensor]], pdl: bool) -> torch.Tensor:
    residual = torch.zeros_like(x)
    for w in weights:
        normed, residual = rmsnorm(x, w["norm1"], 1e-5, residual, pdl=pdl)
        qkv = gemv(normed, w["qkv"], pdl=pdl)
        attn = gemv(qkv[:, :HIDDEN], w["o"], pdl=pdl)  # a strided row: no copy launch
        normed, residual = rmsnorm(attn, w["norm2"], 1e-5, residual, pdl=pdl)
        gate_up = gemv(normed, w["gate_up"], pdl=pdl)
        x = gemv(gate_up, w["down"], gated=True, pdl=pdl)
    normed, _ = rmsnorm(x, weights[0]["norm1"], 1e-5, residual, pdl=pdl)
    return normed


def fused_step(
    x: torch.Tensor,
    weights: list[dict[str, torch.Tensor]],
    pdl: bool,
    configs: dict[str, GemvConfig] | None = None,
) -> torch.Tensor:
    """`step` as services/worker/accel/decode_chain.py runs it: the o and down reduces fused into the
    residual add and the next norm (7 launches a layer instead of 9); the same values.
    `configs`: GEMV tile configs by weight name ("qkv", "o", "gate_up", "down"; default: the
    launcher's choice), for bench/gpu/gemv_chain_sweep.py."""
    cfg = configs or {}
    stream = x  # `step` adds a zero residual first: x + 0 rounds to x
    normed, _ = rmsnorm(stream, weights[0]["norm1"], 1e-5, pdl=pdl)
    for i, w in enumerate(weights):
        qkv = gemv(normed, w["qkv"], cfg.get("qkv"), pdl=pdl)
        attn = qkv[:, :HIDDEN]
        normed, stream = gemv_add_rmsnorm(
            attn, w["o"], stream, w["norm2"], 1e-5, cfg.get("o"), pdl=pdl
        )
        gate_up = gemv(normed, w["gate_up"], cfg.get("gate_up"), pdl=pdl)
        nxt = weights[i + 1]["norm1"] if i + 1 < len(weights) else weights[0]["norm1"]
        normed, stream = gemv_add_rmsnorm(
            gate_up, w["down"], stream, nxt, 1e-5, cfg.get("down"), gated=True, pdl=pdl
        )
    return normed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--replays", type=int, default=9)
    args = p.parse_args()
    torch.manual_seed(0)
    weights = layer_weights(args.layers)
    modes = {"plain": (step, False), "pdl": (step, True), "fused": (fused_step, True)}
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        graphs, outputs = {}, {}
        for name, (fn, pdl) in modes.items():
            fn(x, weights, pdl)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs[name] = fn(x, weights, pdl)
            graphs[name] = graph
        times = rotating_replays(graphs, args.replays)
        same = all(torch.equal(outputs["plain"], out) for out in outputs.values())
        base = statistics.median(times["plain"])
        launches = 9 * args.layers + 1
        for name in modes:
            med = statistics.median(times[name])
            print(
                f"rows {rows} {name:6s}: {med:7.1f} us for {launches} launches "
                f"({(base - med) / launches:+.2f} us a launch vs plain, {base / med:.3f}x); "
                f"replays {sorted(round(t) for t in times[name])}",
                flush=True,
            )
        print(f"rows {rows}: outputs identical across modes: {same}", flush=True)
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
