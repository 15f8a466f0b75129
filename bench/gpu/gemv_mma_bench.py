"""The warpgroup-MMA skinny product (kernels/gemv_ws_mma.py) on the H200, issue #9: its numbers
against an fp64 reference, and its speed in 32-layer chains against what runs those rows today.

    python3 -m bench.gpu.gemv_mma_bench check               # every shape, 2..64 rows, errors
    python3 -m bench.gpu.gemv_mma_bench chain [--rows 2 4 8 16]
        # the decode chain (bench/gpu/pdl_chain.py fused_step, 15 GB of weights, one graph):
        # the MMA kernel against the tensor-core GEMV at 2..16 rows, replays rotating
    python3 -m bench.gpu.gemv_mma_bench products [--rows 16 32 64]
        # the layer products alone (qkv, o, gate_up, SiLU-and-multiply + down), 32 layers in a
        # graph: cuBLAS (what runs above 16 rows) against the MMA kernel (PDL chained)
    python3 -m bench.gpu.gemv_mma_bench sweep [--rows 16 64]
        # the MMA kernel's split and ring depth per shape, inside the products chain

Every figure is a median of graph replays (CUDA events); TB/s counts the weights' bytes.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.gpu.graph_replays import captured, rotating_replays
from bench.gpu.pdl_chain import HIDDEN, fused_step, layer_weights
from kernels import gemv as gemv_mod
from kernels.gemv import MMA_CONFIGS, GemvConfig, gemv, gemv_add_rmsnorm
from kernels.rmsnorm import rmsnorm
from kernels.silu_mul import silu_mul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
WEIGHT_BYTES = 32 * sum(2 * n * k for n, k in SHAPES.values())


def check() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        for rows in (2, 3, 8, 13, 16, 24, 32, 64):
            for gated in (False, True) if name == "down" else (False,):
                x = torch.randn(rows, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
                launch = gemv_mod._checked(x, w, None, gated, None)
                got = gemv(x, w, gated=gated).double()
                xs = silu_mul(x) if gated else x
                want = xs.double() @ w.double().t()
                ref = F.linear(xs, w).double()  # cuBLAS, rounded to bf16 once as well
                err = (got - want).abs().max().item()
                ref_err = (ref - want).abs().max().item()
                ok = launch.mma and err <= 1.5 * ref_err + 1e-3
                print(
                    f"check {name:8s} rows {rows:2d} gated {gated!s:5s} mma {launch.mma!s:5s} "
                    f"split {launch.split}: max err {err:.2e} (cuBLAS {ref_err:.2e}) "
                    f"{'ok' if ok else 'FAIL'}",
                    flush=True,
                )
                parts = gemv_mod.gemv_partials(x, w) if not gated else None
                if parts is not None and parts.shape[0] > 1:
                    split, stage_k = parts.shape[0], launch.config.block_k
                    steps, worst = k // stage_k, 0.0
                    for s in range(split):  # uneven splits of whole ring stages
                        cols = slice(
                            s * steps // split * stage_k, (s + 1) * steps // split * stage_k
                        )
                        exact = x[:, cols].double() @ w[:, cols].double().t()
                        worst = max(worst, (parts[s].double() - exact).abs().max().item())
                    print(f"      partials [{parts.shape[0]}, {rows}, {n}]: max err {worst:.2e}")


def medians(graphs: dict[str, torch.cuda.CUDAGraph], replays: int) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in rotating_replays(graphs, replays).items()}


def with_mma(on: bool, run: Callable[[], object]) -> Callable[[], None]:
    def go() -> None:
        saved = gemv_mod.GEMV_MMA_DEFAULT
        gemv_mod.GEMV_MMA_DEFAULT = on
        try:
            run()
        finally:
            gemv_mod.GEMV_MMA_DEFAULT = saved

    return go


def chain(rows_list: list[int], replays: int) -> None:
    weights = layer_weights(32)
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        outs: dict[str, torch.Tensor] = {}
        graphs = {}
        for name, on in (("tensor-core gemv", False), ("mma", True)):

            def run(
                on: bool = on, name: str = name, x: torch.Tensor = x, outs: dict = outs
            ) -> None:
                outs[name] = fused_step(x, weights, True)

            graphs[name] = captured(with_mma(on, run))
        med = medians(graphs, replays)
        a, b = outs["tensor-core gemv"].float(), outs["mma"].float()
        diff = (a - b).abs().max().item()
        base = med["tensor-core gemv"]
        print(
            f"chain rows {rows:2d}: tensor-core gemv {base:8.1f} us, mma {med['mma']:8.1f} us "
            f"({base / med['mma']:.3f}x), outputs differ by at most {diff:.3g}",
            flush=True,
        )


def products_step(x: torch.Tensor, weights: list[dict[str, torch.Tensor]], mma: bool) -> None:
    for w in weights:
        if mma:
            gemv(x, w["qkv"], pdl=True)
            gemv(x, w["o"], pdl=True)
            gate_up = gemv(x, w["gate_up"], pdl=True)
            gemv(gate_up, w["down"], gated=True, pdl=True)
        else:
            F.linear(x, w["qkv"])
            F.linear(x, w["o"])
            gate_up = F.linear(x, w["gate_up"])
            F.linear(silu_mul(gate_up), w["down"])


def products(rows_list: list[int], replays: int) -> None:
    weights = layer_weights(32)
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        graphs = {
            "cuBLAS": captured(lambda x=x: products_step(x, weights, False)),
            "mma": captured(lambda x=x: products_step(x, weights, True)),
        }
        med = medians(graphs, replays)
        print(
            f"products rows {rows:2d}: cuBLAS {med['cuBLAS']:8.1f} us "
            f"({WEIGHT_BYTES / med['cuBLAS'] / 1e6:.2f} TB/s), mma {med['mma']:8.1f} us "
            f"({WEIGHT_BYTES / med['mma'] / 1e6:.2f} TB/s), {med['cuBLAS'] / med['mma']:.3f}x",
            flush=True,
        )


SWEEP: dict[str, list[tuple[int, int, int]]] = {  # (split, stage K, stages)
    "qkv": [(4, 64, 6), (22, 64, 6), (11, 128, 3)],
    "o": [(4, 64, 6), (33, 64, 6), (16, 64, 6)],
    "gate_up": [(1, 64, 6), (2, 64, 6), (7, 128, 3)],
    "down": [(8, 64, 6), (16, 64, 6), (33, 128, 3)],
}


def sweep(rows_list: list[int], replays: int) -> None:
    weights = layer_weights(32)
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        base = captured(lambda x=x: products_step(x, weights, True))
        for name, candidates in SWEEP.items():
            shape = SHAPES[name]
            saved = MMA_CONFIGS[shape]
            for split, stage_k, stages in candidates:
                MMA_CONFIGS[shape] = GemvConfig(256, stage_k, split, 4, stages)
                try:
                    graph = captured(lambda x=x: products_step(x, weights, True))
                finally:
                    MMA_CONFIGS[shape] = saved
                med = medians({"base": base, "cand": graph}, replays)
                print(
                    f"sweep rows {rows:2d} {name:8s} split {split:2d} stage K {stage_k:3d} "
                    f"stages {stages:2d}: {med['cand'] - med['base']:+7.1f} us a step vs "
                    f"{saved.split_k}/{saved.block_k}/{saved.num_stages} ({med['base']:.1f})",
                    flush=True,
                )
                del graph


def shapes(rows_list: list[int], replays: int) -> None:
    """Each layer shape alone: 32 launches in a graph, each with its own weight (from HBM), for
    cuBLAS, the tensor-core GEMV (<= 16 rows) and the MMA kernel at several splits (`gemv`,
    with its reduce past one split, and `gemv_partials`, the partials alone)."""
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
        nbytes = 32 * 2 * n * k
        shape = (n, k)
        saved = MMA_CONFIGS[shape]
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            graphs = {"cuBLAS": captured(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])}
            if rows <= gemv_mod.MAX_BATCH:
                graphs["tc gemv"] = captured(
                    with_mma(False, lambda x=x, ws=ws: [gemv(x, w, pdl=True) for w in ws])
                )
            for split in (1, 2, 4, 8):
                MMA_CONFIGS[shape] = GemvConfig(256, 64, split, 4, 6)
                try:
                    graphs[f"mma split {split}"] = captured(
                        lambda x=x, ws=ws: [gemv(x, w, pdl=True) for w in ws]
                    )
                    if split > 1:
                        graphs[f"mma split {split} partials"] = captured(
                            lambda x=x, ws=ws: [gemv_mod.gemv_partials(x, w, pdl=True) for w in ws]
                        )
                finally:
                    MMA_CONFIGS[shape] = saved
            med = medians(graphs, replays)
            line = ", ".join(
                f"{g} {t / 32:6.2f} us ({nbytes / t / 1e6:.2f} TB/s)" for g, t in med.items()
            )
            print(f"shape {name:8s} rows {rows:2d}: {line}", flush=True)
            del graphs


VARIANTS: dict[str, tuple[frozenset[str], bool]] = {  # (products on the MMA kernel, cuBLAS gate_up)
    "base": (frozenset(), False),
    "cuBLAS gate_up": (frozenset(), True),
    "mma qkv o down": (frozenset({"qkv", "o", "down"}), False),
    "mma qkv o down + cuBLAS gate_up": (frozenset({"qkv", "o", "down"}), True),
    "mma down": (frozenset({"down"}), False),
    "mma qkv o": (frozenset({"qkv", "o"}), False),
}
VARIANT_SPLITS = {"qkv": 8, "o": 8, "down": 8}


def variant_step(
    x: torch.Tensor, weights: list[dict[str, torch.Tensor]], mma: frozenset[str], cublas: bool
) -> torch.Tensor:
    """fused_step's chain with the qkv partials left for the attention (as the worker's chain
    does), each product on the MMA kernel or not, gate_up on cuBLAS or the GEMV."""

    def on(name: str) -> None:
        gemv_mod.GEMV_MMA_DEFAULT = name in mma

    stream = x
    normed, _ = rmsnorm(stream, weights[0]["norm1"], 1e-5, pdl=True)
    for i, w in enumerate(weights):
        on("qkv")
        gemv_mod.gemv_partials(normed, w["qkv"], pdl=True)  # the attention's input
        on("o")
        normed, stream = gemv_add_rmsnorm(normed, w["o"], stream, w["norm2"], 1e-5, pdl=True)
        if cublas:
            gate_up = F.linear(normed, w["gate_up"])
        else:
            on("gate_up")
            gate_up = gemv(normed, w["gate_up"], pdl=True)
        nxt = weights[i + 1]["norm1"] if i + 1 < len(weights) else weights[0]["norm1"]
        on("down")
        normed, stream = gemv_add_rmsnorm(
            gate_up, w["down"], stream, nxt, 1e-5, gated=True, pdl=True
        )
    gemv_mod.GEMV_MMA_DEFAULT = True
    return normed


def variants(rows_list: list[int], replays: int) -> None:
    weights = layer_weights(32)
    saved = dict(MMA_CONFIGS)
    for name, split in VARIANT_SPLITS.items():
        cfg = MMA_CONFIGS[SHAPES[name]]
        MMA_CONFIGS[SHAPES[name]] = GemvConfig(256, 64, split, 4, cfg.num_stages)
    try:
        for rows in rows_list:
            x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
            outs: dict[str, torch.Tensor] = {}
            graphs = {}
            for name, (mma, cublas) in VARIANTS.items():

                def run(
                    name: str = name, mma: frozenset[str] = mma, cublas: bool = cublas,
                    x: torch.Tensor = x, outs: dict = outs,
                ) -> None:  # fmt: skip
                    outs[name] = variant_step(x, weights, mma, cublas)

                graphs[name] = captured(run)
            med = medians(graphs, replays)
            base = med["base"]
            for name, t in med.items():
                diff = (outs[name].float() - outs["base"].float()).abs().max().item()
                print(
                    f"variant rows {rows:2d} {name:32s} {t:8.1f} us ({t - base:+7.1f}), "
                    f"output differs by {diff:.3g}",
                    flush=True,
                )
    finally:
        MMA_CONFIGS.update(saved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("part", choices=["check", "chain", "products", "sweep", "shapes", "variants"])
    p.add_argument("--rows", type=int, nargs="+")
    p.add_argument("--replays", type=int, default=9)
    args = p.parse_args()
    torch.manual_seed(0)
    if args.part == "check":
        check()
    elif args.part == "chain":
        chain(args.rows or [2, 4, 8, 16], args.replays)
    elif args.part == "products":
        products(args.rows or [16, 32, 64], args.replays)
    elif args.part == "variants":
        variants(args.rows or [2, 8, 16], args.replays)
    elif args.part == "shapes":
        shapes(args.rows or [2, 16, 32, 64], args.replays)
    else:
        sweep(args.rows or [16, 64], args.replays)


if __name__ == "__main__":
    main()
