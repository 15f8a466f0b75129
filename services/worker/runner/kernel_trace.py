"""Where a profiled run of the worker's steps spends its device time, kernel by kernel, and how
much of it is gaps. Read offline (bench/worker_step.py --profile --trace), never while serving.

Reads a torch.profiler chrome trace (`prof.export_chrome_trace`) and sorts its device events
(kernels inside CUDA graph replays included, and the copies and fills between them) by start
time. A gap is the idle time between one event's end and the next one's start; gaps longer
than `step_gap_us` are taken as the time between steps (host work, the sync) and reported
apart from the gaps inside a step.

    python -m services.worker.runner.kernel_trace TRACE.json [--steps N]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from dataclasses import dataclass

# Device activity: kernels, and the copies and fills that occupy the stream between them.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    dur_us: float


def load_kernels(path: str) -> list[Kernel]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [
        Kernel(e["name"], float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"
    ]
    return sorted(kernels, key=lambda k: k.start_us)


def summarize_trace(path: str, steps: int = 1, step_gap_us: float = 50.0) -> str:
    kernels = load_kernels(path)
    if not kernels:
        return "no kernel events in the trace"
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k.name[:60]].append(k.dur_us)
    inner: list[float] = []
    between: list[float] = []
    by_pair: dict[str, list[float]] = defaultdict(list)  # gaps inside steps, by kernel pair
    for a, b in itertools.pairwise(kernels):
        gap = max(0.0, b.start_us - _end(a))
        (between if gap > step_gap_us else inner).append(gap)
        if gap <= step_gap_us:
            by_pair[f"{_short(a.name)} -> {_short(b.name)}"].append(gap)
    busy = sum(k.dur_us for k in kernels)
    lines = [f"{len(kernels)} kernels over {steps} step(s); per step:"]
    lines.append(f"{'kernel':<60} {'calls':>6} {'us':>9} {'us/call':>8}")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        lines.append(
            f"{name:<60} {len(durs) / steps:>6.1f} {sum(durs) / steps:>9.1f} "
            f"{sum(durs) / len(durs):>8.2f}"
        )
    lines.append(
        f"kernel time {busy / steps:.1f} us; gaps inside steps {sum(inner) / steps:.1f} us "
        f"({len(inner) / steps:.0f} gaps, mean {sum(inner) / max(1, len(inner)):.2f} us); "
        f"gaps > {step_gap_us:.0f} us (between steps) {sum(between) / steps:.1f} us; "
        f"first start to last end {(max(map(_end, kernels)) - kernels[0].start_us) / steps:.1f} us"
    )
    lines.append(f"{'gaps inside steps, by kernel pair':<60} {'count':>6} {'us':>9} {'us/gap':>8}")
    for pair, gaps in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:12]:
        lines.append(
            f"{pair[:60]:<60} {len(gaps) / steps:>6.1f} {sum(gaps) / steps:>9.1f} "
            f"{sum(gaps) / len(gaps):>8.2f}"
        )
    return "\n".join(lines)


def _end(k: Kernel) -> float:
    return k.start_us + k.dur_us


def _short(name: str) -> str:
    return name[:28]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    print(summarize_trace(args.trace, args.steps))


if __name__ == "__main__":
    main()
