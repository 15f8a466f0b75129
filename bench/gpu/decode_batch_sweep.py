"""Decode attention at large batches and short contexts (the batch-64/256 decode steps of
bench/gpu/decode_e2e.py: ~512-640 keys a sequence): the single-pass kernel's tile configs,
and 2-way split-K, against the launcher's default. CUDA-graph times over two cache copies
(kernel_timings.graph_ms), medians of alternating repeats; GB/s counts the K/V bytes read.

    python3 bench/gpu/decode_batch_sweep.py            # on the H200

H200, 2026-11-30 (bench/gpu/decode_batch_h200.log, 3 repeats): the default single pass (n64 w4
s2) reads 3.85 TB/s at 256 x 576 and 3.67 at 64 x 576. Only n32 w2 s2 at batch 256 stood out
(144.9 vs 157.0 us, 1.08x) and it was 0.95x at batch 64; n64 w2 s2 was 1.02x at both. A
second call with 9 repeats (decode_batch_confirm_h200.log: 1.07-1.09x at 128-256 sequences,
tight spreads) and a third at 1024-4096 keys (decode_tiles_h200.log) confirmed it, and the
launcher now takes those tiles from 1024 (sequence, kv head) programs on
(kernels/attention/paged_decode.py single_pass_tiles).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.gpu.kernel_checks import HEAD_DIM, KV_HEADS, make_paged  # noqa: E402
from bench.gpu.kernel_timings import graph_ms  # noqa: E402
from kernels.attention.paged_decode import paged_decode_attention  # noqa: E402
from kernels.attention.tile_step import AttentionTiles  # noqa: E402

CASES = [(256, 576), (64, 576)]
CONFIGS: list[tuple[int, AttentionTiles | None]] = (
    [(1, None)]
    + [
        (1, AttentionTiles(block_n=bn, num_warps=nw, num_stages=ns))
        for bn, nw, ns in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
        if not (bn == 128 and ns == 4)
    ]
    + [(2, None), (4, None)]
)


FOCUS = [
    (1, None),
    *(
        (1, AttentionTiles(block_n=bn, num_warps=nw, num_stages=ns))
        for bn, nw, ns in ((32, 2, 2), (32, 2, 3), (32, 4, 2), (64, 2, 2), (64, 4, 2))
    ),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", nargs="+", default=[f"{b}x{k}" for b, k in CASES])
    p.add_argument("--focus", action="store_true", help="the default and 4 configs only")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    configs = FOCUS if args.focus else CONFIGS
    for case in args.cases:
        batch, keys = (int(v) for v in case.split("x"))
        copies = [make_paged([keys] * batch, [1] * batch) for _ in range(2)]
        nbytes = batch * keys * KV_HEADS * HEAD_DIM * 2 * 2
        ref = paged_decode_attention(
            copies[0].q, copies[0].cache, copies[0].tables, copies[0].lens, max_seq_len=keys
        )
        times: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for splits, tiles in configs:
                name = f"splits {splits} " + (
                    f"n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}" if tiles else "auto"
                )
                calls = [
                    lambda b=b, s=splits, t=tiles, k=keys: paged_decode_attention(
                        b.q, b.cache, b.tables, b.lens, max_seq_len=k, num_splits=s, tiles=t
                    )
                    for b in copies
                ]
                try:
                    out = calls[0]()
                    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
                    times.setdefault(name, []).append(graph_ms(calls))
                except Exception as exc:  # a config the compiler or the checks refuse
                    times.setdefault(name, []).append(float("nan"))
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
        print(f"batch {batch} x {keys} keys ({nbytes / 1e6:.0f} MB of K/V):", flush=True)
        rows = sorted(((statistics.median(v), k) for k, v in times.items()), key=lambda r: r[0])
        spread = {k: (min(v), max(v)) for k, v in times.items()}
        default = statistics.median(times["splits 1 auto"])
        for ms, name in rows[:10]:
            print(
                f"  {name:<24} {ms * 1000:8.1f} us {nbytes / ms / 1e6:7.0f} GB/s "
                f"{default / ms:5.2f}x vs default (repeats {spread[name][0] * 1000:.1f}-"
                f"{spread[name][1] * 1000:.1f} us)",
                flush=True,
            )
        print(f"  {'splits 1 auto':<24} {default * 1000:8.1f} us (default)", flush=True)


if __name__ == "__main__":
    main()
