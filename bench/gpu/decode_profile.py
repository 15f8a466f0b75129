"""Where a decode step's device time goes at a given batch, on a CUDA GPU, in one process: the
worker's own runner (bootstrap.build_runner from the MESHLLM_* settings below, warm-up and CUDA
graphs as the worker serves) stepped by the scheduler core, `batch` prompts prefilled, then
decode-only steps timed (wall time of each step, which waits for its tokens: no overlap of
steps, unlike the mesh), the step's CUDA graph replayed alone (its kernels and the gaps between
them, without the host's part), and a few more steps under the PyTorch profiler: each kernel's
device time per step, grouped as GEMM (cuBLAS / CUTLASS), attention and the rest, beside the
step's bytes (weights + the K/V its attention reads) at the card's HBM read rate measured at the
end (run_bound.measure_rates).

    python3 -m bench.gpu.decode_profile --batch 64 256 --out $OUT/decode_profile.json
    python3 -m bench.gpu.decode_profile --batch 64 --blas cublaslt   # cuBLASLt for the GEMMs

`--blas` picks PyTorch's preferred BLAS library before the model is built (the graphs capture
what it picks). The profiler does not see every kernel of a graph replay: a kernel's
`calls_per_step` below its count in the model (e.g. 32 a step, one per layer) says how many of
its runs were recorded; per-call times stay right.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from bench.gpu.run_bound import ModelCosts, Rates, measure_rates, run_bound
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.worker.models.random_init import random_source
from services.worker.runner.bootstrap import build_runner
from shared.config import WorkerSettings
from shared.protocol import SamplingParams, SubmitRequest

GEMM_MARKS = ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "cublas")
ATTENTION_MARKS = ("_prefill_kernel", "_decode_", "attention", "flash")


def kernel_group(name: str) -> str:
    low = name.lower()
    if any(m in low for m in ATTENTION_MARKS):  # first: flash-attention's names say cutlass
        return "attention"
    if any(m in low for m in GEMM_MARKS):
        return "gemm"
    return "other"


def decode_only(plan: Any) -> bool:
    return all(n == 1 for n in plan.num_scheduled_tokens.values())


def kernel_table(prof: Any, per: float, top: int, cuda: bool) -> dict[str, Any]:
    """The profiled kernels' device time divided by `per` (steps), grouped and the `top`
    kernels (on CPU, the operators: a check of this program only)."""
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA or not cuda:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    totals = {name: sum(t) / per for name, t in kernels.items()}
    groups: dict[str, float] = {}
    for name, us in totals.items():
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + us
    return {
        "device_us": {k: round(v, 1) for k, v in sorted(groups.items())},
        "kernels": [
            {
                "kernel": name[:110],
                "calls": len(kernels[name]) / per,
                "us_per_call": round(statistics.mean(kernels[name]), 2),
                "us": round(us, 1),
                "group": kernel_group(name),
            }
            for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]
        ],
    }


def graph_replay_ms(runner: Any, batch: int, replays: int = 20) -> float | None:
    """Device time of one replay of the decode graph a `batch`-row step runs, CUDA events
    around `replays` back-to-back replays of the inputs the last step staged (its K/V rows are
    rewritten with the same values): the kernels plus the gaps between them inside the graph,
    without the host's part of a step. None without graphs."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None or not getattr(graphs, "graphs", None):
        return None
    graph = graphs.graphs[graphs.graph_size(batch)]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def profile_batch(
    runner: Any,
    scheduler: Scheduler,
    batch: int,
    args: argparse.Namespace,
    rates: Rates,
) -> dict:
    """One batch size on the runner and scheduler the earlier sizes used (the finished
    requests of the last one leave the runner's batch with this one's first plan)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    costs = ModelCosts.of(runner.config)
    rng = np.random.default_rng(batch)
    # the first prompts decode while the later ones prefill (one token a chunk): enough
    # tokens that every request is still decoding when the steps are timed and replayed
    prefill_chunks = -(-batch * args.prompt // args.max_num_batched_tokens)
    steps_needed = args.warm_steps + args.timed_steps + args.profiled_steps + prefill_chunks + 3
    params = SamplingParams(temperature=0.0, max_tokens=steps_needed + 1, ignore_eos=True)
    vocab = runner.config.vocab_size
    for i in range(batch):
        prompt = rng.integers(100, vocab - 100, args.prompt).tolist()
        scheduler.add_request(
            SubmitRequest(
                request_id=f"b{batch}-{i}",
                prompt_token_ids=prompt,
                sampling=params,
                reply_stream="r",
            )
        )

    def run(plan: Any) -> Any:
        scheduler.update_from_output(plan, runner.execute(plan))
        return plan

    def step() -> Any:
        plan = scheduler.schedule()
        assert plan is not None
        return run(plan)

    # The prefill chunks (eager, as the worker runs them by default), profiled whole.
    chunks = 0
    t0 = time.perf_counter()
    with profile(activities=activities) as prefill_prof:
        while not decode_only(plan := scheduler.schedule()):
            run(plan)
            chunks += 1
    prefill_ms = (time.perf_counter() - t0) * 1000.0
    run(plan)  # the first decode-only step
    prefill_bound = run_bound(costs, rates, batch, args.prompt, 1)["prefill_s"] * 1000.0
    for _ in range(args.warm_steps):
        assert decode_only(step())
    step_ms = []
    for _ in range(args.timed_steps):  # a step returns its tokens to the host: synchronous
        t0 = time.perf_counter()
        plan = step()
        step_ms.append((time.perf_counter() - t0) * 1000.0)
        assert decode_only(plan)
    replay_ms = graph_replay_ms(runner, batch) if cuda else None
    with profile(activities=activities) as decode_prof:
        for _ in range(args.profiled_steps):
            step()
    while scheduler.has_work():  # the runner's batch must be empty for the next batch size
        step()
    # the mean context: a prompt of chunk c (0-based) decoded (chunks - 1 - c) tokens early
    context = args.prompt + 1 + args.warm_steps + args.timed_steps + (prefill_chunks - 1) // 2
    weight_gb = (costs.layer_params + costs.head_params) * costs.dtype_bytes / 1e9
    kv_gb = batch * context * costs.kv_bytes_per_token / 1e9
    bound_ms = (weight_gb + kv_gb) / rates.read_tbs
    median = statistics.median(step_ms)
    return {
        "batch": batch,
        "prefill": {
            "steps": chunks,
            "wall_ms": round(prefill_ms, 1),
            "bound_ms": round(prefill_bound, 1),
            **kernel_table(prefill_prof, 1.0, args.top, cuda),
        },
        "decode": {
            "context": context,
            "step_ms": [round(x, 3) for x in step_ms],
            "median_step_ms": round(median, 3),
            "graph_replay_ms": None if replay_ms is None else round(replay_ms, 3),
            "weights_gb": round(weight_gb, 2),
            "kv_read_gb": round(kv_gb, 2),
            "bound_ms": round(bound_ms, 3),
            "of_bound": round(bound_ms / median, 3),
            **kernel_table(decode_prof, args.profiled_steps, args.top, cuda),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--warm-steps", type=int, default=4)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--profiled-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--gemv-max-rows", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default")
    parser.add_argument("--device", default="cuda", help="cpu: a check of this program only")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    settings = WorkerSettings(
        model=args.model,
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_model_len=args.prompt + 64,
        kv_cache_bytes=24 * 2**30 if args.device == "cuda" else 2**24,
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=args.max_num_batched_tokens,
        gemv_max_rows=args.gemv_max_rows,
        kv_offload=False,
    )
    # the card's read rate first, on an empty GPU (a nominal 1 TB/s on CPU)
    rates = measure_rates() if args.device == "cuda" else Rates(read_tbs=1.0, gemm_tflops=1.0)
    runner, ready = build_runner(random_source(args.model), settings, "profile")
    scheduler = Scheduler(
        SchedulerConfig(
            num_gpu_blocks=ready.num_kv_blocks,
            max_model_len=ready.max_model_len,
            max_num_seqs=max(args.batch),
            max_num_batched_tokens=args.max_num_batched_tokens,
            eos_token_ids=[],
            vocab_size=ready.vocab_size,
        ),
        "profile",
    )
    results = {
        "model": args.model,
        "blas": args.blas,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "rates": asdict(rates),
        "runs": [profile_batch(runner, scheduler, b, args, rates) for b in args.batch],
    }
    for run in results["runs"]:
        pre, dec = run["prefill"], run["decode"]
        print(
            f"batch {run['batch']}: prefill {pre['wall_ms']} ms in {pre['steps']} steps (bound "
            f"{pre['bound_ms']} ms), device us {pre['device_us']}; decode step "
            f"{dec['median_step_ms']} ms (graph replay {dec['graph_replay_ms']} ms), bound "
            f"{dec['bound_ms']} ms ({dec['of_bound']:.0%}), "
            f"device us/step {dec['device_us']}",
            flush=True,
        )
        for phase in (pre, dec):
            for k in phase["kernels"][:14]:
                print(
                    f"  {k['us']:10.1f} us {k['us_per_call']:9.2f} us/call "
                    f"x{k['calls']:<6g} {k['kernel']}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
