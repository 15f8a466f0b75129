"""Decode attention on the H200: the split-K kernel against its strided variants.

    python3 bench/gpu/decode_variants.py [--out PATH] [--repeats N] [--no-sweep] [--extra ...]

One run, so every number shares one machine state: the read ceiling (2 GiB `sum`, as
kernel_timings.time_hbm_ceiling), the floor of one streaming kernel over a decode-sized buffer
(`sum` of 134 MB), the split-K merge kernel alone, then (unless --no-sweep) a batch-1 32k
sweep of strided-kernel configs (tiles, stages, splits, fused merge), and finally the old
kernel, the launcher's default, the strided kernel forced on and the sweep's best at batch 1,
2, 4 and 8 at 32k, batch 64 at 4k and fp8 batch 1 at 32k, in alternating order over several
repeats. Times are CUDA-graph times over two cache copies (kernel_timings.graph_ms). Prints a
table last; writes a JSON (default $OUT/decode_variants.json). The first run of this script
(bench/gpu/decode_variants_h200_run1.*) also timed a grouped kernel (several kv heads per
program) and pure-read probes; that kernel lost everywhere and was removed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.gpu.kernel_checks import HEAD_DIM, HEADS, KV_HEADS, make_paged  # noqa: E402
from bench.gpu.kernel_timings import graph_ms, median_ms  # noqa: E402
from kernels.attention.paged_decode import (  # noqa: E402
    _decode_reduce_kernel,
    default_num_splits,
    paged_decode_attention,
    paged_decode_reference,
)
from kernels.attention.tile_step import AttentionTiles  # noqa: E402
from kernels.runtime.tensor_checks import FP8_E4M3  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """One launch configuration; None fields are the launcher's choice."""

    name: str
    strided: bool | None = None
    fused_merge: bool | None = None
    tiles: AttentionTiles | None = None
    splits: int | None = None  # None: default_num_splits

    def kwargs(self) -> dict[str, Any]:
        return {
            "strided": self.strided,
            "fused_merge": self.fused_merge,
            "tiles": self.tiles,
            "num_splits": self.splits,
        }


def strided(fm: bool, bn: int, nw: int, ns: int, splits: int | None) -> Variant:
    name = f"strided{' +merge' if fm else ''} n{bn} w{nw} s{ns} sp{splits or 'auto'}"
    tiles = AttentionTiles(block_n=bn, num_warps=nw, num_stages=ns)
    return Variant(name, True, fm, tiles, splits)


OLD = Variant("old (per kv head, auto)", strided=False)
# (fused merge, block_n, warps, stages, splits). ptxas (Triton 3.6, sm_90a): n128 s2 ~220
# registers and 72 KB shared (2 programs per SM), single-buffered K/V like the old kernel;
# n128 s3 double-buffers K/V (139 KB: 1 program per SM); n64 s3/s4 double/triple-buffers in
# 70/100 KB. The fused merge holds [4, splits, 128] fp32: <= 32 splits at 4 warps.
STRIDED_CONFIGS = [
    (False, 128, 4, 2, 32),
    (True, 128, 4, 2, 32),
    (True, 128, 4, 2, 24),
    (True, 128, 4, 2, 16),
    (False, 128, 4, 3, 16),
    (True, 128, 4, 3, 16),
    (True, 128, 8, 3, 16),
    (False, 128, 4, 3, 32),
    (True, 128, 4, 3, 32),
    (False, 64, 4, 3, 32),
    (True, 64, 4, 3, 32),
    (False, 64, 4, 3, 64),
    (True, 64, 8, 3, 32),
    (True, 64, 4, 4, 32),
    (False, 64, 4, 4, 64),
    (True, 64, 4, 2, 32),
]


@dataclass
class Results:
    env: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **row: Any) -> None:
        self.rows.append(row)
        print("  " + " ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


@dataclass
class Case:
    name: str
    lens: list[int]
    batches: list[Any]
    nbytes: int


def make_case(name: str, lens: list[int], **kw: Any) -> Case:
    bs = [make_paged(lens, [1] * len(lens), **kw) for _ in range(2)]
    elem = bs[0].cache.element_size()
    nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * elem + 2 * bs[0].q.numel() * 2
    return Case(name, lens, bs, nbytes)


def calls(case: Case, v: Variant) -> list:  # type: ignore[type-arg]
    return [
        lambda b=b: paged_decode_attention(
            b.q, b.cache, b.tables, b.lens, max_seq_len=b.max_len, **b.scales, **v.kwargs()
        )
        for b in case.batches
    ]


def check(case: Case, v: Variant, launches: int = 5) -> float:
    """Relative error against the fp32 reference (first sequence only: the reference is a
    Python loop), output NaN-poisoned before each launch; NaN if any of `launches` launches
    differs from the first in any bit (a race: e.g. a merge reading unfinished pieces)."""
    b = case.batches[0]
    outs = []
    for _ in range(launches):
        out = torch.full_like(b.q, float("nan"))
        paged_decode_attention(
            b.q, b.cache, b.tables, b.lens, max_seq_len=b.max_len, out=out, **b.scales,
            **v.kwargs(),
        )  # fmt: skip
        outs.append(out)
    if any(not torch.equal(o, outs[0]) for o in outs[1:]):
        return float("nan")
    n = 1
    ref = paged_decode_reference(b.q[:n], b.cache, b.tables[:n], b.lens[:n], **b.scales)
    o = outs[0][:n].float()
    if o.isnan().any():
        return float("nan")
    return float((o - ref.float()).norm() / ref.float().norm())


def reduce_calls(pieces: int) -> list:  # type: ignore[type-arg]
    bufs = [
        (
            torch.randn(1, HEADS, pieces, HEAD_DIM, device="cuda"),
            torch.randn(1, HEADS, pieces, device="cuda"),
            torch.empty(1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]

    def one(p: torch.Tensor, lse: torch.Tensor, o: torch.Tensor) -> None:
        _decode_reduce_kernel[(1, HEADS)](
            p, lse, o, o.stride(0), o.stride(1), NUM_HEADS=HEADS, NUM_SPLITS=pieces,
            BLOCK_S=max(2, triton.next_power_of_2(pieces)), HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM,
        )  # fmt: skip

    return [lambda b=b: one(*b) for b in bufs]


def run_ab(
    cases: list[Case],
    ab: list[Variant],
    as_launched: Any,
    repeats: int,
    res: Results,
    ceiling: float,
    sms: int,
    t0: float,
) -> list[dict[str, Any]]:
    """Every variant of `ab` on every case, in alternating order, `repeats` times."""

    def timed(case: Case, v: Variant) -> float:
        return graph_ms(calls(case, v)) * 1e3

    summary: list[dict[str, Any]] = []
    for case in cases:
        try:
            nsp = default_num_splits(len(case.lens), KV_HEADS, max(case.lens), sms)
            times: dict[str, list[float]] = {v.name: [] for v in ab}
            errs: dict[str, float] = {}
            for v in ab:
                try:
                    errs[v.name] = check(case, as_launched(case, v))
                except Exception as exc:
                    res.notes.append(f"{case.name} {v.name} failed: {exc!r}"[:300])
                    print(res.notes[-1], flush=True)
            order = [v for v in ab if v.name in errs]
            for r in range(repeats):
                for v in order if r % 2 == 0 else order[::-1]:
                    times[v.name].append(timed(case, as_launched(case, v)))
            for v in order:
                ts = times[v.name]
                med = statistics.median(ts)
                pct = 100 * case.nbytes / (med * 1e-6) / 1e9 / ceiling
                row = {
                    "case": case.name, "variant": v.name, "us_median": med, "us_min": min(ts),
                    "us_max": max(ts), "pct_ceiling": pct, "pct_4200": pct * ceiling / 4200,
                    "rel_err": errs[v.name], "default_splits": nsp, "times": ts,
                }  # fmt: skip
                summary.append(row)
                res.add(kind="A/B", **{k: v for k, v in row.items() if k != "times"})
            print(f"[{case.name} done, {time.perf_counter() - t0:.0f} s]", flush=True)

        except Exception as exc:  # one failing case must not cost the others
            res.notes.append(f"{case.name} A/B failed: {exc!r}"[:300])
            print(res.notes[-1], flush=True)
        case.batches = []
        torch.cuda.empty_cache()

    return summary


def write_results(
    out: Path, res: Results, summary: list[dict[str, Any]], ceiling: float, t0: float
) -> None:
    import json

    res.env["wall_s"] = round(time.perf_counter() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"env": res.env, "rows": res.rows, "summary": summary, "notes": res.notes},
            indent=1,
            default=str,
        )
    )
    print(f"\nwrote {out}\nread ceiling {ceiling:.0f} GB/s (same run)\n")
    print("| case | variant | us median | min | max | % ceiling | % of 4.2 TB/s | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for row in summary:
        print(
            f"| {row['case']} | {row['variant']} | {row['us_median']:.1f} | {row['us_min']:.1f} "
            f"| {row['us_max']:.1f} | {row['pct_ceiling']:.1f} | {row['pct_4200']:.1f} "
            f"| {row['rel_err']:.1e} |"
        )
    for n in res.notes:
        print("note:", n)


def short_contexts(args: Any, res: Results, ceiling: float, sms: int, t0: float) -> int:
    """Batch 1-2 at short contexts: is one launch with the merge fused and more, shorter
    pieces faster than the old kernel at the default split count (2 pieces at 512 keys)?"""
    ab = [OLD, Variant("launcher default")]
    for sp in (4, 8, 16):
        ab.append(Variant(f"strided +merge sp{sp}", True, True, None, sp))
    for sp in (4, 8):
        ab.append(Variant(f"old sp{sp}", False, None, None, sp))
    cases = [
        make_case("b1 512", [512]),
        make_case("b1 1k", [1024]),
        make_case("b1 2k", [2048]),
        make_case("b1 4k", [4096]),
        make_case("b2 512", [512] * 2),
    ]
    summary = run_ab(cases, ab, lambda case, v: v, args.repeats, res, ceiling, sms, t0)
    write_results(args.out, res, summary, ceiling, t0)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ.get("OUT", ROOT / "bench" / "gpu")) / "decode_variants.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=4, help="sweep winners taken to the A/B")
    parser.add_argument("--no-sweep", action="store_true", help="A/B of the fixed list only")
    parser.add_argument(
        "--extra", default="", help="extra strided configs merge,bn,warps,stages,splits;..."
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="batch 1-2 at 512-4096 keys (the e2e decode benchmark's contexts), fixed split "
        "counts of both kernels against the launcher's choice; no sweep",
    )
    args = parser.parse_args()

    props = torch.cuda.get_device_properties(0)
    res = Results(
        env={
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "triton": triton.__version__,
        }
    )
    torch.manual_seed(0)
    t0 = time.perf_counter()

    # Ceiling and floors, same run.
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    ms = median_ms(lambda s=src: s.sum())
    ceiling = src.numel() * 4 / (ms * 1e-3) / 1e9
    res.env["read_ceiling_GBs"] = ceiling
    res.add(kind="ceiling", what="read-only sum 2 GiB", us=ms * 1e3, GBs=ceiling)
    del src
    flat = [torch.randn(1 << 25, device="cuda") for _ in range(2)]  # 134 MB each
    ms = graph_ms([lambda x=x: x.sum() for x in flat])
    res.add(
        kind="floor",
        what="sum 134 MB (graph)",
        us=ms * 1e3,
        pct=100 * 134.2e6 / ms / 1e9 / ceiling * 1e3,
    )
    del flat

    if args.short:
        return short_contexts(args, res, ceiling, props.multi_processor_count, t0)
    b1 = make_case("b1 32k", [32768])
    for pieces in (16, 32):
        try:
            ms = graph_ms(reduce_calls(pieces))
            res.add(kind="merge alone", what=f"{pieces} pieces, 32 heads", us=ms * 1e3)
        except Exception as exc:
            res.notes.append(f"merge {pieces} failed: {exc!r}"[:300])
            print(res.notes[-1], flush=True)
    print(f"[floors done, {time.perf_counter() - t0:.0f} s]", flush=True)

    def timed(case: Case, v: Variant) -> float:
        return graph_ms(calls(case, v)) * 1e3

    def as_launched(case: Case, v: Variant) -> Variant:
        """Sweep winners carry batch 1's split count; other batches get the default one."""
        return v if case is b1 else replace(v, splits=None)

    sweep: list[tuple[float, Variant]] = []
    extra = [tuple(int(x) for x in e.split(",")) for e in args.extra.split(";") if e.strip()]
    if not args.no_sweep:
        candidates = [strided(bool(f), n, w, st, sp) for f, n, w, st, sp in STRIDED_CONFIGS]
        candidates += [strided(bool(f), n, w, st, sp) for f, n, w, st, sp in extra]
        for v in [OLD, *candidates]:
            try:
                err = check(b1, v)
                us = timed(b1, v)
            except Exception as exc:  # a config the compiler rejects is skipped
                res.notes.append(f"{v.name} failed: {exc!r}"[:300])
                print(res.notes[-1], flush=True)
                continue
            pct = 100 * b1.nbytes / (us * 1e-6) / 1e9 / ceiling
            res.add(kind="sweep b1 32k", what=v.name, us=us, pct=pct, rel_err=err)
            if v is not OLD and err < 2e-2:
                sweep.append((us, v))
        sweep.sort(key=lambda t: t[0])
        print(f"[sweep done, {time.perf_counter() - t0:.0f} s]", flush=True)
    forced = Variant("strided +merge, launcher tiles", strided=True, fused_merge=True)
    ab = [OLD, Variant("launcher default"), forced] + [v for _, v in sweep[: args.top]]
    if args.no_sweep:
        ab += [strided(bool(f), n, w, st, sp) for f, n, w, st, sp in extra]

    cases = [
        b1,
        make_case("b2 32k", [32768] * 2),
        make_case("b4 32k", [32768] * 4),
        make_case("b8 32k", [32768] * 8),
        make_case("b64 4k", [4096] * 64),
        make_case("fp8 b1 32k", [32768], cache_dtype=FP8_E4M3),
    ]
    summary = run_ab(
        cases, ab, as_launched, args.repeats, res, ceiling, props.multi_processor_count, t0
    )
    write_results(args.out, res, summary, ceiling, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
