"""Where a batch-1 decode step's device time goes inside the PDL chain, kernel by kernel, from
a CUDA trace of one step (issue #9).

ncu (bench/gpu/b1_step_kernels.py) replays each kernel alone with cold caches, and under PDL a
kernel's start is when it became resident, not when it began its work, so neither says what a
kernel costs where it runs. What it costs in the chain is how much later the chain ends
because of it: the distance from the previous kernel's end to its own end. Those distances
add up to the step.

    python3 -m bench.gpu.chain_trace --trace T.json [--kernels]   # drive one step, trace it
    python3 -m bench.gpu.chain_trace --read T.json [--kernels]    # a trace written before
    python3 -m bench.gpu.chain_trace --steady 4 --trace T.json --kernels
        # 4 consecutive decode steps as the worker runs them (step N+1 launched before N is
        # finished, fed on the device; no synchronisation before), copies included

The step is bench/gpu/b1_step_kernels.py's (the worker's runner, Llama-3-8B shape, random
weights, decode step 8 after a 512-token prompt: graph replay, LM head, sampling), traced by
the PyTorch profiler (CUPTI; CUDA graph kernels included). Prints, per kind of kernel (a GEMV
by its grid, which tells the projections apart), the launches, the summed in-chain cost and
the summed duration; --kernels lists every kernel.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.protocol import StepPlan

# The decode chain's GEMV grids at the Llama-3-8B shape, one row (kernels/decode_chain/gemv.py configs).
GEMV_GRIDS = {
    (96, 2): "gemv qkv",
    (64, 2): "gemv o",
    (224, 1): "gemv gate_up",
    (64, 4): "gemv down",
    (1002, 1): "gemv LM head",
}


@dataclass(frozen=True)
class Kernel:
    name: str
    grid: tuple[int, int, int]
    start: int  # ns
    end: int

    @property
    def kind(self) -> str:
        if self.name.startswith("_gemv_kernel"):
            return GEMV_GRIDS.get(self.grid[:2], f"gemv grid {self.grid[:2]}")
        return self.name[:48]


def kernels(path: str) -> list[Kernel]:
    """The kernels of a Chrome trace (torch.profiler's export) in order of their end."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    found = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        grid = tuple(e.get("args", {}).get("grid", (0, 0, 0)))
        start = int(float(e["ts"]) * 1e3)
        found.append(Kernel(e["name"], grid, start, start + int(float(e["dur"]) * 1e3)))  # type: ignore[arg-type]
    return sorted(found, key=lambda k: k.end)


def trace_step(path: str) -> None:
    """Drives the request, tracing decode step 8 with the PyTorch profiler into `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu.b1_step_kernels import drive

    profilers: list[profile] = []

    def around() -> profile:
        profilers.append(profile(activities=[ProfilerActivity.CUDA]))
        return profilers[-1]

    drive(8, 512, 12, "llama-3-8b", "cuda", around=around)
    torch.cuda.synchronize()
    profilers[-1].export_chrome_trace(path)


def trace_steady(path: str, steps: int) -> None:
    """Traces `steps` consecutive decode steps from decode step 8, launched as the worker
    launches them (overlapped: each launched before the previous one is finished), so the
    glue between two steps' graphs (sampling, copies, the token feed) is as in the mesh."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu.b1_step_kernels import engine, greedy

    eng = engine("llama-3-8b", "cuda")
    launch = eng.runner.launch
    decodes = 0
    prof = profile(activities=[ProfilerActivity.CUDA])

    def traced(plan: StepPlan) -> object:
        nonlocal decodes
        decodes += all(n == 1 for n in plan.num_scheduled_tokens.values())
        if decodes == 8:
            prof.__enter__()
        launched = launch(plan)
        if decodes == 8 + steps:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(path)
        return launched

    eng.runner.launch = traced  # type: ignore[method-assign]
    eng.submit("r0", [(31 * j) % 128000 + 1 for j in range(512)], greedy(8 + steps + 4))
    eng.run(overlap=True)


def report(found: list[Kernel], listing: bool) -> None:
    if not found:
        print("no kernels in the trace")
        return
    first = min(k.start for k in found)
    cost: dict[str, float] = defaultdict(float)
    duration: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    previous_end = first
    if listing:
        print(f"{'kernel':50s} {'grid':>14s} {'start us':>9s} {'dur us':>8s} {'cost us':>8s}")
    for k in found:
        in_chain = (k.end - max(previous_end, first)) / 1e3
        previous_end = max(previous_end, k.end)
        cost[k.kind] += in_chain
        duration[k.kind] += (k.end - k.start) / 1e3
        launches[k.kind] += 1
        if listing:
            print(
                f"{k.kind:50s} {k.grid!s:>14s} {(k.start - first) / 1e3:9.2f} "
                f"{(k.end - k.start) / 1e3:8.2f} {in_chain:8.2f}"
            )
    span = (max(k.end for k in found) - first) / 1e3
    print(f"{'kind':50s} {'launches':>8s} {'cost us':>9s} {'each':>7s} {'dur us':>9s}")
    for kind in sorted(cost, key=lambda kind: -cost[kind]):
        n = launches[kind]
        print(f"{kind:50s} {n:8d} {cost[kind]:9.1f} {cost[kind] / n:7.2f} {duration[kind]:9.1f}")
    print(f"first start to last end: {span:.1f} us over {len(found)} kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="JSON", help="drive and trace one step into JSON")
    source.add_argument("--read", metavar="JSON", help="report a trace written before")
    parser.add_argument("--kernels", action="store_true", help="list every kernel")
    parser.add_argument("--steady", type=int, metavar="STEPS", help="consecutive steps, overlapped")
    args = parser.parse_args()
    if args.trace and args.steady:
        trace_steady(args.trace, args.steady)
    elif args.trace:
        trace_step(args.trace)
    report(kernels(args.trace or args.read), args.kernels)


if __name__ == "__main__":
    main()
