"""vLLM's own benchmark client, `vllm bench serve`, as a pure HTTP client of the gateway.

`make vllm-client` (bench/vllm_client.sh) builds it: vLLM's Python sources from the pinned
wheel without its compiled parts, and the client's requirements. It runs in a process of its
own, with VLLM_TARGET_DEVICE=cpu so that vLLM resolves no GPU platform (it would import CUDA
extensions the client never uses). `run()` takes bench/serve.py's arguments, so a benchmark
drives the same workload with either client, and returns vllm bench serve's result JSON (the
same metric names as bench/serve.py's).

    make vllm-client
    .venv/bin/python -m bench.vllm_client --base-url http://127.0.0.1:8000 \
        --model SmolLM2-135M-Instruct --tokenizer .tokenizer --dataset-name random \
        --random-input-len 256 --random-output-len 128 --ignore-eos --num-prompts 32

Where the client lives: MESHLLM_VLLM_CLIENT_PATH (a PYTHONPATH; bench/gpu/run.sh sets it to
what it unpacked), else .vllmclient/site and .vllmclient/src of this tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / ".vllmclient"
MAIN = "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"


def client_path() -> str:
    """The PYTHONPATH entries that hold the client and its requirements."""
    return os.environ.get("MESHLLM_VLLM_CLIENT_PATH") or f"{LOCAL / 'site'}:{LOCAL / 'src'}"


def available() -> bool:
    """Whether the client is built (or unpacked where MESHLLM_VLLM_CLIENT_PATH says)."""
    return any((Path(p) / "vllm" / "benchmarks").is_dir() for p in client_path().split(":"))


def command(cli_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one `vllm <cli_args>` process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(p for p in (client_path(), env.get("PYTHONPATH", "")) if p)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return [sys.executable, "-c", MAIN, *cli_args], env


def serve_cli_args(args: argparse.Namespace, tokenizer: Path, result: Path) -> list[str]:
    """`vllm bench serve` flags for the workload of bench/serve.py's arguments `args`:
    streamed /v1/completions, `output_len` tokens each (ignore_eos, greedy), the same
    datasets (random prompts, or `num_prefixes` prefixes of `prefix_len` tokens followed by
    `input_len` tokens of each prompt's own), arrival rate, burstiness and concurrency."""
    base = args.base_url.rstrip("/").removesuffix("/v1")
    cli = [
        "bench", "serve", "--backend", "vllm", "--base-url", base, "--tokenizer", str(tokenizer),
        "--num-prompts", str(args.num_prompts), "--ignore-eos", "--temperature", "0",
        "--seed", str(args.seed), "--burstiness", str(args.burstiness),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", args.percentiles,
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm", "--ready-check-timeout-sec", "0",
    ]  # fmt: skip
    if args.model:
        cli += ["--model", args.model]
    if not math.isinf(args.request_rate):
        cli += ["--request-rate", str(args.request_rate)]
    if args.max_concurrency:
        cli += ["--max-concurrency", str(args.max_concurrency)]
    if args.num_warmups:
        cli += ["--num-warmups", str(args.num_warmups)]
    if args.goodput:
        cli += ["--goodput", *args.goodput]
    if args.dataset == "shared-prefix":
        cli += [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.input_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
        ]  # fmt: skip
    else:
        cli += [
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio),
        ]  # fmt: skip
    return cli


async def run(args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    """One `vllm bench serve` run of bench/serve.py's workload `args`; its result JSON.
    Raises when the client exits non-zero or writes no result."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        result = Path(tmp) / "result.json"
        argv, env = command(serve_cli_args(args, tokenizer, result))
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), args.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode or not result.exists():
            tail = out.decode(errors="replace")[-3000:]
            raise RuntimeError(f"vllm bench serve exited {proc.returncode}:\n{tail}")
        ran: dict[str, Any] = json.loads(result.read_text())
    errors = [e for e in ran.pop("errors", []) if e][:3]
    for per_request in ("ttfts", "itls", "generated_texts", "input_lens", "output_lens",
                        "latencies", "queue_times", "start_times"):  # fmt: skip
        ran.pop(per_request, None)
    if errors:
        ran["errors"] = errors
    ran["client"] = "vllm bench serve"
    return ran


def main() -> None:
    """`python -m bench.vllm_client ARGS`: `vllm bench serve ARGS` with the built client."""
    argv, env = command(["bench", "serve", *sys.argv[1:]])
    os.execve(sys.executable, argv, env)


if __name__ == "__main__":
    main()
