"""Every kernel of one batch-1 decode step, one at a time, under Nsight Compute (issue #9: where
a batch-1 token goes, kernel by kernel).

The PyTorch profiler's kernel durations overlap under PDL (each kernel of the decode chain is
resident, waiting, while its predecessor runs), so they do not say what each kernel costs. ncu
replays each kernel on its own, caches flushed: its duration is the kernel's without any
overlap with its neighbours, and the sum over the step against the step's time in the graph
is what the PDL chain hides.

Drive (the worker's runner, Llama-3-8B shape, random weights, one request of 512 prompt tokens;
the profiler range is one decode step after a few, graph replay + LM head + sampling):

    ncu --profile-from-start off --clock-control none --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 -m bench.gpu.b1_step_kernels > K.csv
    python3 -m bench.gpu.b1_step_kernels --summarize K.csv
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from services.worker.models.random_init import PRESETS, build_random_model
from shared.protocol import SamplingParams, StepPlan
from tests.support.engine import InProcessEngine


@contextlib.contextmanager
def cuda_profiler_range() -> Iterator[None]:
    """What ncu --profile-from-start off profiles: cudaProfilerStart .. cudaProfilerStop."""
    torch.cuda.cudart().cudaProfilerStart()
    try:
        yield
    finally:
        torch.cuda.cudart().cudaProfilerStop()


def engine(preset: str, device: str) -> InProcessEngine:
    """The worker's runner on a random-weight model of `preset`, warmed up, graphs captured."""
    model, config = build_random_model(PRESETS[preset], torch.bfloat16, device, 4096)
    eng = InProcessEngine(
        "unused",
        model_and_config=(model, config),
        device=device,
        num_blocks=256,
        block_size=16,
        max_num_batched_tokens=8192,
        max_num_seqs=1,
        dtype=torch.bfloat16,
    )
    eng.runner.warmup()
    if device == "cuda":
        eng.runner.capture_cuda_graphs()
    return eng


def greedy(output: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)


def drive(
    step: int,
    prompt: int,
    output: int,
    preset: str,
    device: str,
    around: Callable[[], contextlib.AbstractContextManager[object]] = cuda_profiler_range,
) -> None:
    """Runs one request; decode step `step` (launch to its tokens) inside `around()`."""
    eng = engine(preset, device)
    cuda = device == "cuda"
    launch = eng.runner.launch
    decodes = 0

    def profiled(plan: StepPlan) -> object:
        nonlocal decodes
        decode = all(n == 1 for n in plan.num_scheduled_tokens.values())
        decodes += decode
        if not (decode and decodes == step):
            return launch(plan)
        if not cuda:  # a dry run of the driver
            return launch(plan)
        torch.cuda.synchronize()
        with around():
            launched = launch(plan)
            torch.cuda.synchronize()
        return launched

    eng.runner.launch = profiled  # type: ignore[method-assign]
    eng.submit("r0", [(31 * j) % 128000 + 1 for j in range(prompt)], greedy(output))
    eng.run()
    print(f"profiled decode step {step} of {decodes}")


UNITS = {
    "ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
    "byte": 1.0, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9,
}  # fmt: skip


def summarize(path: str) -> None:
    """Per kernel name: launches, total and mean duration (us), DRAM bytes read and GB/s."""
    with open(path) as f:
        text = f.read()
    rows = list(csv.DictReader(io.StringIO(text[text.find('"ID"') :])))
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        if row.get("Metric Value") is None:  # a line after the table (not ncu's)
            continue
        value = float(row["Metric Value"].replace(",", "")) * UNITS.get(row["Metric Unit"], 1.0)
        totals[row["Kernel Name"][:60]][row["Metric Name"]] += value
        totals[row["Kernel Name"][:60]]["rows"] += 1
    print(
        f"{'kernel':60s} {'launches':>8s} {'us':>9s} {'us each':>8s} {'MB read':>9s} {'GB/s':>6s}"
    )
    step_us = 0.0
    for name, t in totals.items():
        n = t["rows"] / 2  # two metrics a launch
        us, mb = t["gpu__time_duration.sum"], t["dram__bytes_read.sum"] / 1e6
        step_us += us
        print(f"{name:60s} {n:8.0f} {us:9.1f} {us / n:8.2f} {mb:9.1f} {mb / us * 1e3:6.0f}")
    launches = sum(t["rows"] for t in totals.values()) / 2
    print(f"sum of kernel durations: {step_us:.1f} us over {launches:.0f} launches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--step", type=int, default=8, help="which decode step to profile")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=12)
    parser.add_argument("--summarize", metavar="CSV")
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the driver")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        drive(args.step, args.prompt, args.output, args.preset, args.device)


if __name__ == "__main__":
    main()
