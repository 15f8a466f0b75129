"""Timing kernels on a CUDA GPU the way the worker runs them: captured in CUDA graphs (no
launch overhead), inputs rotated so every call reads HBM rather than L2, and each time set
beside the bytes it moves, the FLOPs it does and a baseline. Used by kernel_timings.py.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

HBM_MEASURED_GBS = 4200.0  # read bandwidth measured on the H200 (a sum over 8 GB: 4.16 TB/s)


@dataclass
class Report:
    """Timing rows and notes; a failing part is recorded with its traceback."""

    env: dict[str, Any] = field(default_factory=dict)
    timings: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:  # one broken kernel must not cost the others' numbers
            self.failures.append({"part": name, "error": repr(exc), "tb": traceback.format_exc()})
            print(f"[FAIL] {name}: {exc!r}", flush=True)
        else:
            print(f"[done] {name} ({time.perf_counter() - start:.1f} s)", flush=True)

    def timing(
        self,
        kernel: str,
        shape: str,
        ms: float,
        *,
        bytes_moved: float | None = None,
        flops: float | None = None,
        baseline: str | None = None,
        baseline_ms: float | None = None,
        **extra: Any,
    ) -> None:
        row: dict[str, Any] = {"kernel": kernel, "shape": shape, "us": ms * 1e3, **extra}
        if bytes_moved is not None:
            row["GB/s"] = bytes_moved / (ms * 1e-3) / 1e9
            row["%HBM"] = 100 * row["GB/s"] / HBM_MEASURED_GBS
        if flops is not None:
            row["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
        if baseline is not None and baseline_ms is not None:
            row |= {"baseline": baseline, "baseline_us": baseline_ms * 1e3}
            row["speedup"] = baseline_ms / ms
        self.timings.append(row)
        print(
            f"  {kernel} {shape}: "
            + ", ".join(f"{k}={_num(v)}" for k, v in row.items() if k not in ("kernel", "shape")),
            flush=True,
        )

    def markdown(self) -> str:
        lines = [
            f"kernel timings on {self.env.get('gpu')} (torch {self.env.get('torch')}, "
            f"triton {self.env.get('triton')}); %HBM against {HBM_MEASURED_GBS:.0f} GB/s",
            "",
            "| kernel | shape | us | GB/s | %HBM | TFLOP/s | baseline | base us | speedup |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in self.timings:
            cells = [t["kernel"], t["shape"], _num(t["us"], 1), _num(t.get("GB/s"), 0),
                     _num(t.get("%HBM"), 0), _num(t.get("TFLOP/s"), 1), t.get("baseline", ""),
                     _num(t.get("baseline_us"), 1), _num(t.get("speedup"), 2)]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines += [f"\nFAILED {f['part']}: {f['error']}" for f in self.failures]
        lines += [f"\nnote: {n}" for n in self.notes]
        return "\n".join(lines)


def _num(v: Any, digits: int = 3) -> str:
    if v is None:
        return ""
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def captured(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`run` in a CUDA graph, after one warm-up run on a side stream (compiles and
    allocations happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def median_ms(fn: Callable[[], Any]) -> float:
    """Eager time (triton's do_bench median; it flushes L2 before every call)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "L2_cache_size", 60 << 20))


def copies_for(nbytes: int) -> int:
    """Input copies to rotate through so each call reads HBM, not L2 (4x the L2 in total)."""
    return max(1, min(32, -(-4 * l2_bytes() // max(1, nbytes))))


def graph_ms(calls: list[Callable[[], Any]], replays: int = 7) -> float:
    """Device time per call: `calls` captured round-robin in one CUDA graph, repeated to ~2 ms,
    median of `replays` replays."""
    for c in calls:  # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    torch.cuda.synchronize()
    rounds = max(1, min(200, int(2.0 / max(start.elapsed_time(end), 1e-3))))

    def run() -> None:
        for _ in range(rounds):
            for c in calls:
                c()

    graph = captured(run)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] / (rounds * len(calls))
