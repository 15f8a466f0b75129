"""Decode through the mesh on a GPU: redis-server + scheduler + worker processes, requests
submitted as token ids on the bus (the random-weight model has no tokenizer, so no gateway).

    python3 -m bench.gpu.mesh_decode --batches 1 64 256 --out $OUT/mesh_decode.json  # GPU
    .venv/bin/python -m bench.gpu.mesh_decode --dry-run                      # CPU, tiny model

On the GPU machine bench/gpu/run.sh puts the bundle's packages and redis-server on the paths
first. Llama-3-8B shape (`random:llama-3-8b`), bf16, prompt 512, output 128 by default; TTFT of long
prompts: `--batches 1 --prompt 8192 --output 64` (the context is sized to the prompt).
Every run sends prompts of its own (salted by its tag): a warm-up's or an earlier run's blocks
must not serve its prefill from the prefix cache, since transformers, the baseline, has none.

After an untimed warm-up (Triton compiles each step kind once), per batch size, `--repeats`
times (best-of-N; every run is reported): `batch` SubmitRequests (prompt `--prompt` token ids,
`--output` greedy tokens, ignore_eos) published at once, asynchronous scheduling on or off
(`--async-scheduling`); the TokenDelta replies are read from a reply stream and timestamped on
arrival. Reported: output tokens/s over the run (the figure to set beside transformers'), decode
tokens/s per request (tokens after the first over the time since the first), the share of the
run the GPU had no step queued, and the mesh's own cost per step from the scheduler's metrics:
meshllm:scheduler_overhead_seconds (step wall time minus the worker's execute_ms: scheduling,
both bus hops, result handling) over meshllm:scheduler_step_seconds, as deltas over the run.
Last, each batch's computed bound with the best run's share of it (bench/gpu/run_bound.py;
dense models only), from the card's HBM read and bf16 GEMM rates measured before the mesh
starts and after it stops, the faster of each.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.gpu.run_bound import Rates, bounds, measure_rates
from bench.serve import random_prompts
from shared.bus import Bus
from shared.heartbeat import Heartbeater
from shared.protocol import SamplingParams, SubmitRequest, TokenDelta
from shared.streams import Streams
from tests.support.mesh import Mesh

# --dry-run: a 2-layer Llama small enough for a CPU.
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}


async def _always_ready() -> bool:
    return True


def scrape(mesh: Mesh) -> dict[str, float]:
    """Histogram sums and counts of the scheduler's step and overhead metrics, the worker's
    device-busy seconds, and its Triton compiles after the warm-up (serving stalls)."""
    text = httpx.get(f"{mesh.url('scheduler')}/metrics", timeout=10).text
    text += httpx.get(f"{mesh.url('worker')}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("scheduler_step_seconds", "scheduler_overhead_seconds", "worker_device"):
            for suffix in ("_sum", "_count", "_busy_seconds_total"):
                key = f"meshllm:{name}{suffix}"
                if line.startswith(key + " ") or line.startswith(key + "{"):
                    values[name + suffix] = float(line.rsplit(" ", 1)[1])
        for name in ("worker_jit_compiles_total", "worker_jit_compile_seconds_total"):
            if line.startswith(f'meshllm:{name}{{phase="serving"}} '):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


#: What the worker logs of its start's phases (services/worker/runner/bootstrap.py and the
#: kernels it compiles, the graphs it captures): a GPU run's start time, phase by phase.
START_PHASES = ("loaded on", "compiled in", "CUDA graphs for batch sizes")


def start_phases(mesh: Mesh) -> list[str]:
    """The worker's log lines about its start's phases, each with its seconds."""
    lines = []
    for log in sorted(mesh.logdir.glob("worker.*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if any(phase in line for phase in START_PHASES):
                lines.append(line.strip()[-300:])
    return lines


def prompt_ids(request_id: str, length: int, vocab: int) -> list[int]:
    """`length` token ids drawn for `request_id` alone (bench/serve.py's random prompts, seeded
    by it): no request of any run shares a prompt block with another, so the warm-up's or an
    earlier run's blocks never serve a run's prefill from the prefix cache (transformers, the
    baseline, has none).
    The affine prompts salted per run that this replaces did share: the 16 prompts of
    gateway_serve's `direct-16-0` were 16 of the 64 of `direct-64-0` (a quarter of its prefill
    cached), which made the "first direct run at c 64" 9-13% faster than every other run."""
    return random_prompts(1, length, vocab, seed=request_id)[0]


async def run_batch(mesh: Mesh, batch: int, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    streams = Streams(mesh.cluster)
    bus = Bus(mesh.redis.url, f"bench-{tag}")
    await bus.connect()
    reply = streams.replies(f"bench-{tag}")
    # Beat as the gateway owning `reply` does: the scheduler aborts the requests of a reply
    # stream nobody beats for (MESHLLM_GATEWAY_TIMEOUT_S), and a long run outlasts that.
    beats_done = asyncio.Event()
    beater = Heartbeater(
        bus, streams.heartbeats, service="gateway", instance_id=f"bench-{tag}", group="0",
        interval_s=1.0, is_ready=_always_ready,
    )  # fmt: skip
    beating = asyncio.create_task(beater.run(beats_done))
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    before = scrape(mesh)
    arrivals: dict[str, list[float]] = {f"{tag}-{i}": [] for i in range(batch)}
    tokens_of: dict[str, list[int]] = {rid: [] for rid in arrivals}
    submits = [
        (
            streams.requests,
            SubmitRequest(
                request_id=rid,
                prompt_token_ids=prompt_ids(rid, args.prompt, args.vocab),
                sampling=params,
                reply_stream=reply,
                arrival_time=time.time(),
            ),
        )
        for i, rid in enumerate(arrivals)
    ]
    last = {reply: "0"}
    started = time.perf_counter()
    await bus.publish_many(submits)  # type: ignore[arg-type]
    finished: set[str] = set()
    deadline = time.monotonic() + args.timeout
    while len(finished) < batch and time.monotonic() < deadline:
        for delivery in await bus.read(last, count=256, block_ms=1000):
            now = time.perf_counter()
            msg = delivery.message
            if not isinstance(msg, TokenDelta):
                continue
            for delta in msg.deltas:
                if delta.request_id in arrivals:
                    arrivals[delta.request_id].extend([now] * len(delta.token_ids))
                    tokens_of[delta.request_id].extend(delta.token_ids)
                    if delta.error:
                        raise RuntimeError(f"{delta.request_id}: {delta.error}")
                    if delta.finish_reason is not None:
                        finished.add(delta.request_id)
    wall = time.perf_counter() - started
    beats_done.set()
    await beating
    await bus.close()
    after = scrape(mesh)
    if len(finished) < batch:
        late = {rid: len(tokens_of[rid]) for rid in arrivals if rid not in finished}
        raise TimeoutError(
            f"{len(late)} of {batch} requests unfinished after {args.timeout:g} s "
            f"(id: tokens received): {dict(list(late.items())[:8])}"
        )
    tokens = sum(len(t) for t in arrivals.values())
    per_request = [
        (len(t) - 1) / (t[-1] - t[0]) for t in arrivals.values() if len(t) > 1 and t[-1] > t[0]
    ]
    ttfts = sorted(1000 * (t[0] - started) for t in arrivals.values() if t)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = delta.get("scheduler_step_seconds_count", 0.0)
    step_s = delta.get("scheduler_step_seconds_sum", 0.0)
    overhead_s = delta.get("scheduler_overhead_seconds_sum", 0.0)
    busy_s = delta.get("worker_device_busy_seconds_total", 0.0)
    return {
        "batch": batch,
        "prompt": args.prompt,
        "output": args.output,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 1),
        "decode_tok_s_per_request_median": round(sorted(per_request)[len(per_request) // 2], 1)
        if per_request
        else None,
        # submitted -> first token, every request of the run (the batch's prompts prefilled
        # in chunks of MESHLLM_MAX_NUM_BATCHED_TOKENS)
        "ttft_ms_median": round(ttfts[len(ttfts) // 2], 1) if ttfts else None,
        "ttft_ms_max": round(ttfts[-1], 1) if ttfts else None,
        "steps": int(steps),
        "step_ms_mean": round(1000 * step_s / steps, 3) if steps else None,
        "overhead_ms_mean": round(1000 * overhead_s / steps, 3) if steps else None,
        "overhead_fraction": round(overhead_s / step_s, 4) if step_s else None,
        # share of the run's wall time the GPU had no step queued: the mesh's cost per step
        # once steps overlap (execute_ms then spans the wait behind the previous step)
        "device_idle_fraction": round(1 - busy_s / wall, 4) if busy_s else None,
        # Triton compiles in this run (the worker's warm-up did not cover them) and their time
        "jit_compiles": int(delta.get("worker_jit_compiles_total", 0.0)),
        "jit_compile_s": round(delta.get("worker_jit_compile_seconds_total", 0.0), 2),
        # greedy tokens of every request, in request order: equal digests = identical outputs
        "tokens_sha256": hashlib.sha256(
            json.dumps([tokens_of[rid] for rid in arrivals]).encode()
        ).hexdigest()[:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument(
        "--async-scheduling",
        choices=("true", "false"),
        default="true",
        help="MESHLLM_ASYNC_SCHEDULING: plan step N+1 while the worker runs step N",
    )
    parser.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="MESHLLM_OVERLAP_STEPS: launch step N+1 while step N runs (auto: on for CUDA)",
    )
    parser.add_argument(
        "--schedule-ahead", default="3", help="MESHLLM_SCHEDULE_AHEAD: plans out at once (2-3)"
    )
    parser.add_argument(
        "--timeline",
        default="",
        help="MESHLLM_STEP_TIMELINE of the worker: a line per step "
        "(python -m services.worker.runner.step_timeline_report FILE reads it)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="MESHLLM_ENFORCE_EAGER: no CUDA graphs"
    )
    parser.add_argument(
        "--gemv-max-rows",
        type=int,
        default=16,
        help="MESHLLM_GEMV_MAX_ROWS: steps of up to this many rows run the GEMV + decode chain",
    )
    parser.add_argument(
        "--kernel-compile-threads",
        type=int,
        default=0,
        help="MESHLLM_KERNEL_COMPILE_THREADS: the warm-up's Triton compiles (1: one by one)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="MESHLLM_MAX_NUM_BATCHED_TOKENS: tokens a step holds (prefill chunk size)",
    )
    parser.add_argument(
        "--dense-prefill",
        default="auto",
        help="MESHLLM_DENSE_PREFILL: fresh prompt spans' attention (auto|sdpa|flash-varlen|off)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per batch (best-of-N)")
    parser.add_argument("--dry-run", action="store_true", help="tiny random model on CPU")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    env = {
        "MESHLLM_MODEL": args.model,
        "MESHLLM_DEVICE": "cuda",
        "MESHLLM_DTYPE": "bfloat16",
        # Room for the prompt and its output (1024 at least): --prompt 32768 runs 32k contexts.
        "MESHLLM_MAX_MODEL_LEN": str(max(1024, args.prompt + args.output)),
        "MESHLLM_KV_CACHE_BYTES": str(24 * 2**30),
        "MESHLLM_MAX_NUM_SEQS": str(max(args.batches)),
        "MESHLLM_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
        "MESHLLM_LOG_JSON": "false",
        "MESHLLM_ASYNC_SCHEDULING": args.async_scheduling,
        "MESHLLM_OVERLAP_STEPS": args.overlap,
        "MESHLLM_STEP_TIMELINE": os.path.abspath(args.timeline) if args.timeline else "",
        "MESHLLM_SCHEDULE_AHEAD": args.schedule_ahead,
        "MESHLLM_ENFORCE_EAGER": str(args.enforce_eager).lower(),
        "MESHLLM_GEMV_MAX_ROWS": str(args.gemv_max_rows),
        "MESHLLM_DENSE_PREFILL": args.dense_prefill,
        "MESHLLM_KERNEL_COMPILE_THREADS": str(args.kernel_compile_threads),
    }
    if args.dry_run:
        config = Path(tempfile.mkdtemp()) / "config.json"
        config.write_text(json.dumps(TINY))
        env.update(
            MESHLLM_MODEL=f"random:{config}",
            MESHLLM_DEVICE="cpu",
            MESHLLM_DTYPE="float32",
            MESHLLM_MAX_MODEL_LEN="64",
            MESHLLM_KV_CACHE_BYTES=str(2**24),
            MESHLLM_NUM_THREADS="1",
        )
        args.prompt, args.output, args.vocab, args.batches = 20, 8, 256, [1, 4]
    results: dict[str, Any] = {
        "model": args.model,
        "async_scheduling": args.async_scheduling == "true",
        "overlap_steps": args.overlap,
        "gemv_max_rows": args.gemv_max_rows,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "dense_prefill": args.dense_prefill,
        "runs": [],
    }
    bounded = not args.dry_run and args.model.startswith("random:")
    # #36's bound: the card's rates measured before the mesh (a cool card) and after it, the
    # faster of each kept (run_bound.measure_rates: the same card varies by ~10% between
    # measurements)
    rates_before = measure_rates() if bounded else None
    mesh = Mesh(services=("scheduler", "worker"), env=env)
    # A `timeout` on this script sends SIGTERM: exit through `finally` so the services stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        mesh.redis.start()
        for name in ("scheduler", "worker"):
            mesh.start_service(name)
        started = time.monotonic()
        for name in ("scheduler", "worker"):
            mesh.wait_ready(name, timeout=400)
        results["start_s"] = round(time.monotonic() - started, 1)
        results["start_phases"] = start_phases(mesh)
        print("\n".join(results["start_phases"]), flush=True)
        # Untimed first: allocations, and Triton's compile of each step kind (mixed steps at
        # the largest batch too), which would otherwise land in the timed runs.
        warm = argparse.Namespace(**{**vars(args), "output": 4})
        asyncio.run(run_batch(mesh, 1, args, "warm"))
        asyncio.run(run_batch(mesh, max(args.batches), warm, "warm-max"))
        for repeat in range(args.repeats):
            for i, batch in enumerate(args.batches):  # own ids and reply stream per run
                row = asyncio.run(run_batch(mesh, batch, args, f"run{repeat}.{i}-b{batch}"))
                results["runs"].append(row)
                print("mesh", row, flush=True)
        results["best_tok_s"] = {
            str(b): max(r["throughput_tok_s"] for r in results["runs"] if r["batch"] == b)
            for b in args.batches
        }
    finally:
        logs = {name: mesh.tail(name, 30) for name in ("scheduler", "worker")}
        mesh.stop()
        if os.environ.get("MESH_LOGS") or not results["runs"]:
            for name, tail in logs.items():
                print(f"--- {name} log tail ---\n{tail}")
    if bounded and rates_before is not None:
        after = measure_rates()  # once the mesh freed the GPU
        rates = Rates(
            read_tbs=max(rates_before.read_tbs, after.read_tbs),
            gemm_tflops=max(rates_before.gemm_tflops, after.gemm_tflops),
        )
        results["rates_measured"] = [asdict(rates_before), asdict(after)]
        try:
            results["bound"] = bounds(args.model, args.batches, args.prompt, args.output, rates)
        except ValueError as exc:  # not a dense decoder: no bound
            results["bound"] = {"error": str(exc)}
        results["best_of_bound"] = {
            b: round(tok_s / results["bound"]["per_batch"][b]["bound_tok_s"], 3)
            for b, tok_s in results["best_tok_s"].items()
            if "per_batch" in results["bound"]
        }
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
