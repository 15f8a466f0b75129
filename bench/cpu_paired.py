"""Decode throughput on CPU, engines measured in ALTERNATING blocks: mesh vs transformers vs vLLM.

`bench/cpu_compare.py` runs each engine once, one after the other; on a shared (virtual)
machine whose speed drifts by 2-4x over minutes, that order decides the ranking. Here every
engine is up at once and the blocks rotate — mesh, vLLM, transformers, mesh, vLLM, ... — so
each round compares the engines within a couple of minutes of each other. Reported: per-round
tokens/s and, per engine, the median over rounds of its ratio to transformers in the same round.

    python -m bench.cpu_paired --vllm-python /path/to/vllm-venv/bin/python --rounds 3

The servers idle while another engine runs (a blocked HTTP server, and vLLM's engine waiting on
its queue); the CPU each one burned during the others' blocks is printed so that can be checked.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import serve
from bench.baseline_transformers import measure
from bench.cpu_compare import REPO, stop, wait_http


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children still alive."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def start_mesh(
    args: argparse.Namespace,
    log_dir: Path,
    *,
    port_offset: int = 300,
    extra_env: dict[str, str] | None = None,
    repo: Path = REPO,
) -> tuple[subprocess.Popen[bytes], str]:
    """gateway + scheduler + worker (+ its Redis on args.redis_port) as local processes, run
    from the checkout `repo`; the gateway on 8000 + port_offset. Returns the launcher's process
    and the API's base URL."""
    env = {
        **os.environ,
        "MESHLLM_DTYPE": args.mesh_dtype,
        "MESHLLM_NUM_THREADS": str(args.threads),
        "MESHLLM_KV_CACHE_BYTES": str(512 * 2**20),
        **(extra_env or {}),
    }
    cmd = [sys.executable, "-m", "infra.launcher", "--services", "gateway,scheduler,worker"]
    cmd += ["--port-offset", str(port_offset), "--redis-port", str(args.redis_port)]
    cmd += ["--log-dir", str(log_dir / "mesh")]
    proc = subprocess.Popen(
        cmd, cwd=repo, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{8000 + port_offset}"
    wait_http(f"{base}/ready", proc, 400)
    return proc, f"{base}/v1"


def start_vllm(
    args: argparse.Namespace, model_dir: str, log_dir: Path
) -> tuple[subprocess.Popen[bytes], str]:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
    }
    log = open(log_dir / "vllm.log", "wb")  # noqa: SIM115 - owned by the process
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += ["--port", "18123", "--dtype", "bfloat16", "--max-model-len", "2048"]
    cmd += ["--served-model-name", "smollm2"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=log)
    wait_http("http://127.0.0.1:18123/v1/models", proc, 900)
    return proc, "http://127.0.0.1:18123/v1"


_BLOCKS = itertools.count(1)


def serve_block(url: str, concurrency: int, prompts: int, args: argparse.Namespace) -> float:
    """One block of requests with prompts never sent before (a seed per block): no engine's
    prefix cache serves any of its prefill (transformers, the baseline, has none)."""
    ns = serve.parser().parse_args(
        [
            "--base-url", url, "--num-prompts", str(prompts),
            "--max-concurrency", str(concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--no-warmup", "--seed", str(next(_BLOCKS)),
        ]
    )  # fmt: skip
    return float(asyncio.run(serve.run(ns))["output_throughput"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", default="")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mesh-dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--redis-port", type=int, default=16398)
    p.add_argument("--log-dir", default="bench/results")
    args = p.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    from shared.config import ModelSettings
    from shared.model.source import resolve_model

    settings = ModelSettings()
    model_dir = str(resolve_model(settings.model, settings.model_cache_dir).hf_dir)
    torch.set_num_threads(args.threads)

    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        servers[f"meshllm ({args.mesh_dtype})"] = start_mesh(args, log_dir)
        if args.vllm_python:
            servers["vLLM 0.32 CPU (bf16)"] = start_vllm(args, model_dir, log_dir)
        for _, url in servers.values():  # warm-up: first requests, kernel selection
            serve_block(url, 8, 8, args)
        rows: list[dict[str, object]] = []
        for round_no in range(args.rounds):
            for batch in args.batch:
                prompts = 4 if batch == 1 else 2 * batch
                result: dict[str, float] = {}
                for name, (_proc, url) in servers.items():
                    others = {n: process_cpu_s(s[0].pid) for n, s in servers.items() if n != name}
                    result[name] = serve_block(url, batch, prompts, args)
                    for other, before in others.items():
                        idle = process_cpu_s(servers[other][0].pid) - before
                        result[f"{other} cpu s meanwhile"] = round(idle, 2)
                result["transformers generate (fp32)"] = measure(
                    model_dir, batch, args.input_len, args.output_len, "float32"
                )
                rows.append({"round": round_no, "batch": batch, **result})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)

    shape = f"input {args.input_len}, output {args.output_len}"
    print(f"\nSmolLM2-135M, {args.threads} threads, {shape}, greedy, eos ignored, ", end="")
    print(f"{args.rounds} alternating rounds\n")
    names = [*servers, "transformers generate (fp32)"]
    header = "| engine | " + " | ".join(f"batch {b} tok/s (rounds)" for b in args.batch)
    header += " | " + " | ".join(f"batch {b} median ratio to transformers" for b in args.batch)
    print(header + " |")
    print("|---" * (1 + 2 * len(args.batch)) + "|")
    for name in names:
        cells, ratios = [], []
        for batch in args.batch:
            mine = [r for r in rows if r["batch"] == batch]
            cells.append(" / ".join(f"{float(r[name]):.1f}" for r in mine))  # type: ignore[arg-type]
            ratio = [float(r[name]) / float(r["transformers generate (fp32)"]) for r in mine]  # type: ignore[arg-type]
            ratios.append(f"{statistics.median(ratio):.2f}x")
        print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print(json.dumps({"rows": rows, "finished": time.time()}))


if __name__ == "__main__":
    main()
