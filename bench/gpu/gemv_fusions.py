"""The decode GEMV's fusions on the GPU against the unfused launches they replace: the gated
MLP's down projection with silu(gate) * up fused into the GEMV's loads (`gemv(..., gated=True)`)
vs the eager F.silu and multiply before the GEMV.

(A split-K reduce done by each tile's last split instead of a reduce launch was measured here
too and dropped: 15.66 vs 15.69 us on qkv, 11.63 vs 11.60 on o, 30.64 vs 30.49 on down at 1 row,
the same within 0.5% at 16 rows; bench/gpu/fused_reduce_h200.log.)

Llama-3-8B shapes, bf16, CUDA-graph time per call over weight copies that defeat L2
(bench/gpu/kernel_timings.py `graph_ms`), alternating order, medians of 5:

    python3 bench/gpu/gemv_fusions.py
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from bench.gpu.kernel_timings import copies_for, graph_ms
from kernels.decode_chain.gemv import gemv

HIDDEN, INTERMEDIATE = 4096, 14336


def main() -> int:
    torch.manual_seed(0)
    nbytes = HIDDEN * INTERMEDIATE * 2
    weights = [
        torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        for _ in range(copies_for(nbytes))
    ]
    for rows in (1, 16):
        gate_up = torch.randn(rows, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)

        def eager(w: torch.Tensor, gu: torch.Tensor = gate_up) -> torch.Tensor:
            gate, up = gu.split(INTERMEDIATE, dim=-1)
            return gemv(F.silu(gate) * up, w)

        def fused(w: torch.Tensor, gu: torch.Tensor = gate_up) -> torch.Tensor:
            return gemv(gu, w, gated=True)

        err = float((fused(weights[0]).float() - eager(weights[0]).float()).abs().max())
        times: dict[str, list[float]] = {"eager silu*up + gemv": [], "gated gemv": []}
        for r in range(5):
            order = [("eager silu*up + gemv", eager), ("gated gemv", fused)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                times[name].append(1e3 * graph_ms([lambda w=w, fn=fn: fn(w) for w in weights]))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"rows {rows}: eager {med['eager silu*up + gemv']:.2f} us, gated "
            f"{med['gated gemv']:.2f} us ({nbytes / med['gated gemv'] / 1e3:.0f} GB/s), "
            f"max |diff| {err:.3g}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
