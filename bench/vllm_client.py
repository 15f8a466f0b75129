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
DONE = "@@meshllm-vllm-client-done"
#: Session's client process: one JSON list of CLI arguments a line in, each run's output and
#: then `DONE <exit status>` out.
LOOP = f"""
import json, sys, traceback
from vllm.entrypoints.cli.main import main
for line in sys.stdin:
    sys.argv = ["vllm", *json.loads(line)]
    rc = 0
    try:
        main()
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception:
        traceback.print_exc()
        rc = 1
    print("{DONE}", rc, flush=True)
"""


def client_path() -> str:
    """The PYTHONPATH entries that hold the client and its requirements."""
    return os.environ.get("MESHLLM_VLLM_CLIENT_PATH") or f"{LOCAL / 'site'}:{LOCAL / 'src'}"


def available() -> bool:
    """Whether the client is built (or unpacked where MESHLLM_VLLM_CLIENT_PATH says)."""
    return any((Path(p) / "vllm" / "benchmarks").is_dir() for p in client_path().split(":"))


def command(cli_args: list[str], code: str = MAIN) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one `vllm <cli_args>` process (of a Python running `code`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(p for p in (client_path(), env.get("PYTHONPATH", "")) if p)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return [sys.executable, "-c", code, *cli_args], env


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


class Session:
    """One client process that runs `vllm bench serve` once per `run()`, so its imports (torch,
    vLLM, transformers: ~10 s here, ~25 s on the GPU machine) are paid once, not per run. Each
    run goes through vLLM's CLI entry point as a fresh `vllm bench serve ARGS` would."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Session:
        await self._start()
        return self

    async def _start(self) -> None:
        argv, env = command([], LOOP)
        self.proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, limit=2**20,
        )  # fmt: skip

    async def __aexit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    async def _one(self, cli: list[str]) -> tuple[int, str]:
        """Run `vllm CLI...` in the client process (a new one after a run was cut short):
        (its exit status, what it printed)."""
        if self.proc is None or self.proc.returncode is not None:
            await self._start()
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write((json.dumps(cli) + "\n").encode())
        await self.proc.stdin.drain()
        printed: list[str] = []
        while line := (await self.proc.stdout.readline()).decode(errors="replace"):
            if line.startswith(DONE):
                return int(line.split()[1]), "".join(printed)
            printed.append(line)
        return -1, "".join(printed) + "(the client process ended)"

    async def run(self, args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
        """One `vllm bench serve` run of bench/serve.py's workload `args`; its result JSON.
        Raises when the run fails, writes no result or outlasts `args.timeout`."""
        with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
            result = Path(tmp) / "result.json"
            try:
                rc, out = await asyncio.wait_for(
                    self._one(serve_cli_args(args, tokenizer, result)), args.timeout
                )
            except TimeoutError:
                await self.__aexit__()  # a run cut short leaves the process mid-run
                raise
            if rc or not result.exists():
                raise RuntimeError(f"vllm bench serve exited {rc}:\n{out[-3000:]}")
            ran: dict[str, Any] = json.loads(result.read_text())
        errors = [e for e in ran.pop("errors", []) if e][:3]
        for per_request in ("ttfts", "itls", "generated_texts", "input_lens", "output_lens",
                            "latencies", "queue_times", "start_times"):  # fmt: skip
            ran.pop(per_request, None)
        if errors:
            ran["errors"] = errors
        ran["client"] = "vllm bench serve"
        return ran


async def run(args: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    """One `vllm bench serve` run in a client process of its own (Session.run)."""
    async with Session() as session:
        return await session.run(args, tokenizer)


def main() -> None:
    """`python -m bench.vllm_client ARGS`: `vllm bench serve ARGS` with the built client."""
    argv, env = command(["bench", "serve", *sys.argv[1:]])
    os.execve(sys.executable, argv, env)


if __name__ == "__main__":
    main()
