"""The decode chain's GEMVs with and without the norms inside them, one site at a time, on the
H200 (issue #9): 32 launches of one site (each with weights of its own, so they stream from
HBM) in a CUDA graph, one row, in the PDL chain; graphs replayed in rotating order.

    python3 -m bench.gpu.norms_in_gemvs_kernels [--replays 30]

Sites (Llama-3-8B shapes): qkv (the plain GEMV's partials vs `gemv_normed(partials=True)`,
also with NORM_SCALES_ACCUMULATOR and other tiles), gate_up (`gemv` vs `gemv_normed`), o and
down (`gemv_add_rmsnorm`, two launches, vs `gemv_into_stream`, one). Prints microseconds per
site launch (median of the replays) and which MMA instructions each compiled specialization
of the GEMV kernel uses.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from bench.gpu.graph_replays import captured, rotating_replays
from kernels import gemv as gemv_module
from kernels.gemv import (
    GemvConfig,
    _gemv_kernel,
    gemv,
    gemv_add_rmsnorm,
    gemv_into_stream,
    gemv_normed,
    gemv_partials,
)

HIDDEN, QKV, INTER = 4096, 6144, 14336
LAYERS = 32
EPS = 1e-5


def _weights(n: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(32)]


def _sites() -> dict[str, Callable[[], None]]:
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    gate_up_x = torch.randn(1, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    state = gemv_into_stream(x, _weights(HIDDEN, HIDDEN)[0], x)
    qkv, gate_up = _weights(QKV, HIDDEN), _weights(2 * INTER, HIDDEN)
    o, down = _weights(HIDDEN, HIDDEN), _weights(HIDDEN, INTER)
    unsplit = GemvConfig(block_n=64, block_k=128, split_k=1)

    def each(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        return lambda: [fn(w) for w in weights]

    def scaled(fn: Callable[[torch.Tensor], object]):  # type: ignore[no-untyped-def]
        def run(w: torch.Tensor) -> object:
            gemv_module.NORM_SCALES_ACCUMULATOR = True
            try:
                return fn(w)
            finally:
                gemv_module.NORM_SCALES_ACCUMULATOR = False

        return run

    def qkv_normed(config: GemvConfig | None = None):  # type: ignore[no-untyped-def]
        return lambda w: gemv_normed(state, norm_w, EPS, w, config, partials=True)

    def gate_up_normed(w: torch.Tensor) -> torch.Tensor:
        return gemv_normed(state, norm_w, EPS, w)

    qkv_configs = {
        f"{c.block_n}x{c.block_k}/{c.split_k}": c
        for c in (
            GemvConfig(block_n=32, block_k=128, split_k=1),
            GemvConfig(block_n=64, block_k=128, split_k=1),
            GemvConfig(block_n=32, block_k=128, split_k=2),
            GemvConfig(block_n=64, block_k=64, split_k=2),
        )
    }
    return {
        "qkv plain": each(lambda w: gemv_partials(x, w), qkv),
        "qkv normed": each(qkv_normed(), qkv),
        "qkv normed scaled": each(scaled(qkv_normed()), qkv),
        **{f"qkv scaled {k}": each(scaled(qkv_normed(c)), qkv) for k, c in qkv_configs.items()},
        "gate_up plain": each(lambda w: gemv(x, w), gate_up),
        "gate_up normed": each(gate_up_normed, gate_up),
        "gate_up normed scaled": each(scaled(gate_up_normed), gate_up),
        "o add+norm": each(lambda w: gemv_add_rmsnorm(x, w, x, norm_w, EPS), o),
        "o into stream": each(lambda w: gemv_into_stream(x, w, x), o),
        "o into stream unsplit": each(lambda w: gemv_into_stream(x, w, x, unsplit), o),
        "down add+norm": each(
            lambda w: gemv_add_rmsnorm(gate_up_x, w, x, norm_w, EPS, gated=True), down
        ),
        "down into stream": each(lambda w: gemv_into_stream(gate_up_x, w, x, gated=True), down),
    }


def _mma_kinds() -> None:
    """Which MMA instructions each compiled specialization of the GEMV kernel has."""
    for caches in getattr(_gemv_kernel, "device_caches", {}).values():
        for key, kernel in caches[0].items():
            ptx = kernel.asm.get("ptx", "")
            names = ("NORM_IN", "SCALE_ACC", "INTO_STREAM", "GATED")
            flags = [f for f in names if f"'{f}': True" in str(key) or f"{f}=True" in str(key)]
            print(
                f"  {'+'.join(flags) or 'plain'}: wgmma {ptx.count('wgmma.mma_async')}, "
                f"mma.sync {ptx.count('mma.sync')}, shared {kernel.metadata.shared} B"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    graphs = {name: captured(run) for name, run in _sites().items()}
    times = rotating_replays(graphs, args.replays)
    for name, samples in times.items():
        print(f"{name:24s} {statistics.median(samples) / LAYERS:7.2f} us a site")
    try:
        _mma_kinds()
    except (AttributeError, KeyError, TypeError, IndexError) as e:  # Triton internals move
        print("  (no MMA census:", repr(e), ")")


if __name__ == "__main__":
    main()
