"""How long `ModelRunner.launch` holds the host at batch 256, and on which CUDA runtime calls.

The mesh's step timeline at batch 256 (bench/gpu/no_sync_h200.log) shows launch() of a prefill
step of 8192 tokens returning ~190 ms after it began, about one step of device time, while
tests/gpu/test_no_host_sync_cuda.py finds no synchronizing call in launch() (PyTorch's sync
debug mode sees only the syncs that go through its own helpers). This drives the worker's
runner as the mesh does (Llama-3-8B shape, random weights, 256 requests of 512 prompt tokens,
8192-token steps, steps launched one ahead), times each launch() on the host, and profiles the
run's CUDA runtime calls on the CPU side with their Python call sites.

    python3 -m bench.gpu.launch_profile [--batch 256] [--output 4] [--cprofile]

--cprofile profiles the Python side of every launch() instead (cProfile: where the host time
of a launch goes, by function).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from services.worker.models.random_init import PRESETS, build_random_model
from shared.protocol import SamplingParams, StepPlan
from tests.support.engine import InProcessEngine

BLOCK = 16
BLOCKING = ("Synchronize", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMemcpy(", "Query")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=4)
    parser.add_argument("--kv-gib", type=int, default=24)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    model, config = build_random_model(PRESETS["llama-3-8b"], torch.bfloat16, "cuda", 4096)
    num_blocks = args.kv_gib * 2**30 // (2 * BLOCK * config.num_hidden_layers * 8 * 128 * 2)
    eng = InProcessEngine(
        "unused",
        model_and_config=(model, config),
        device="cuda",
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_batched_tokens=8192,
        max_num_seqs=args.batch,
        dtype=torch.bfloat16,
    )
    eng.runner.warmup()
    eng.runner.capture_cuda_graphs()
    launches: list[tuple[int, int, float]] = []
    launch: Callable[[StepPlan], object] = eng.runner.launch
    host = cProfile.Profile()  # enabled around each launch() of the profiled run (--cprofile)
    profiling = False

    def timed(plan: StepPlan) -> object:
        started = time.perf_counter()
        if profiling:
            host.enable()
        try:
            return launch(plan)
        finally:
            host.disable()
            counts = plan.num_scheduled_tokens.values()
            launches.append(
                (sum(counts), sum(1 for n in counts if n == 1), time.perf_counter() - started)
            )

    eng.runner.launch = timed  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)

    def run(tag: int) -> float:
        for i in range(args.batch):
            prompt = [(7919 * i + 31 * j + 101 * tag) % 128000 + 1 for j in range(args.prompt)]
            eng.submit(f"t{tag}-{i}", prompt, params)
        started = time.perf_counter()
        eng.run(overlap=True, ahead=3)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def report_launches(wall: float) -> None:
        print(f"profiled run {wall:.2f} s, {len(launches)} launches")
        print("launch() host ms per step: tokens (decodes) ms")
        for tokens, decodes, seconds in launches:
            print(f"  {tokens:5d} ({decodes:3d}) {1000 * seconds:8.2f}")

    print(f"warm run {run(0):.2f} s")
    launches.clear()
    if args.cprofile:
        profiling = True
        report_launches(run(1))
        stats = pstats.Stats(host)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        wall = run(1)
    report_launches(wall)
    averages = prof.key_averages()
    blocking = sorted(
        (e for e in averages if any(b in e.key for b in BLOCKING)),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    print("CUDA runtime calls that can block the host, by self CPU time:")
    for e in blocking[:10]:
        print(f"  {e.key}: {e.count} calls, {e.self_cpu_time_total / 1000:.1f} ms")
    print("host ops by self CPU time, with their Python call sites:")
    by_stack = sorted(
        prof.key_averages(group_by_stack_n=10), key=lambda e: e.self_cpu_time_total, reverse=True
    )
    for e in by_stack[:12]:
        print(f"  {e.key}: {e.count} calls, {e.self_cpu_time_total / 1000:.1f} ms")
        for frame in e.stack[:10]:
            print(f"      {frame}")


if __name__ == "__main__":
    main()
