"""Collects check and timing rows for kernels_check.py; every part runs inside `part()`.

A failing part is recorded with its traceback and the run goes on: one broken kernel must
not cost the numbers of the others on a scarce GPU lease.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HBM_NOMINAL_GBS = 4800.0
HBM_MEASURED_GBS = 4200.0
BF16_DENSE_TFLOPS = 790.0  # measured bf16 GEMM on random data on these H200s


@dataclass
class Report:
    env: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:  # record and continue with the next part
            self.failures.append(
                {"part": name, "error": repr(exc), "traceback": traceback.format_exc()}
            )
            print(f"[FAIL] {name}: {exc!r}", flush=True)
        else:
            print(f"[done] {name} ({time.perf_counter() - start:.1f} s)", flush=True)

    def check(self, name: str, ok: bool, **metrics: Any) -> None:
        row = {"name": name, "ok": bool(ok), **metrics}
        self.checks.append(row)
        print(f"  {'ok  ' if ok else 'BAD '} {name} {metrics}", flush=True)

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
            row["%HBM(4.2)"] = 100 * row["GB/s"] / HBM_MEASURED_GBS
        if flops is not None:
            row["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
        if baseline is not None and baseline_ms is not None:
            row["baseline"] = baseline
            row["baseline_us"] = baseline_ms * 1e3
            row["speedup"] = baseline_ms / ms
        self.timings.append(row)
        print(f"  {kernel} {shape}: {_fmt_row(row)}", flush=True)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "env": self.env,
            "checks": self.checks,
            "timings": self.timings,
            "failures": self.failures,
            "notes": self.notes,
        }
        path.write_text(json.dumps(payload, indent=1, default=str))

    def markdown(self) -> str:
        lines = [
            f"## kernels_check on {self.env.get('gpu', '?')} "
            f"(torch {self.env.get('torch')}, triton {self.env.get('triton')})",
            "",
            f"Checks: {sum(c['ok'] for c in self.checks)}/{len(self.checks)} ok, "
            f"{len(self.failures)} parts failed.",
            "",
            "| check | ok | metrics |",
            "|---|---|---|",
        ]
        for c in self.checks:
            metrics = {k: v for k, v in c.items() if k not in ("name", "ok")}
            lines.append(f"| {c['name']} | {'yes' if c['ok'] else 'NO'} | {_fmt_dict(metrics)} |")
        lines += [
            "",
            f"HBM: {HBM_NOMINAL_GBS:.0f} GB/s nominal, ~{HBM_MEASURED_GBS:.0f} measured; "
            f"bf16 dense ~{BF16_DENSE_TFLOPS:.0f} TFLOP/s.",
            "",
            "| kernel | shape | us | GB/s | %HBM | TFLOP/s | baseline | base us | speedup |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in self.timings:
            lines.append(
                f"| {t['kernel']} | {t['shape']} | {t['us']:.1f} | {_num(t.get('GB/s'))} "
                f"| {_num(t.get('%HBM(4.2)'))} | {_num(t.get('TFLOP/s'), 1)} "
                f"| {t.get('baseline', '')} | {_num(t.get('baseline_us'), 1)} "
                f"| {_num(t.get('speedup'), 2)} |"
            )
        for f in self.failures:
            lines.append(f"\nFAILED {f['part']}: {f['error']}")
        for n in self.notes:
            lines.append(f"\nnote: {n}")
        return "\n".join(lines)


def _num(v: float | None, digits: int = 0) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _fmt_dict(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def _fmt_row(row: dict[str, Any]) -> str:
    keys = ("us", "GB/s", "%HBM(4.2)", "TFLOP/s", "baseline_us", "speedup")
    return _fmt_dict({k: row[k] for k in keys if k in row})
