"""Output tokens/s with every request under a JSON schema vs unconstrained: same prompts, same
run, same concurrency (default 8).

Both arms generate exactly `--output-len` tokens per request: unconstrained requests ignore
eos, and the schema cannot be completed in fewer tokens (an array of at least 64 records), so
every constrained request also runs to its length limit. The difference is then the per-step
cost of structured outputs: the scheduler's mask fill and grammar advance, the bitmask on the
bus, the mask applied before sampling. Arms run in adjacent pairs of blocks (the order flips
every pair), so a noisy, shared machine slows both sides of a pair alike: the reported ratio is
the median of the per-pair ratios, next to each arm's median throughput.

Starts the mesh with the grammar service through infra/launcher.py (real Redis ACLs: the
scheduler reads compiled grammars with its read-only user), or drives `--base-url`.

    python -m bench.structured_outputs [--blocks 3] [--num-prompts 16] [--output-len 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.processes import stop, wait_http

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "score": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "required": ["name", "score"],
            },
            "minItems": 64,
        }
    },
    "required": ["records"],
}
TOPICS = ["cities", "rivers", "painters", "planets", "birds", "trees", "rocks", "songs"]


def prompts(n: int) -> list[str]:
    return [f"List {TOPICS[i % len(TOPICS)]} with a score each, as JSON. ({i})" for i in range(n)]


async def one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    args: argparse.Namespace,
    constrained: bool,
) -> int:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "records", "schema": SCHEMA},
        }
    resp = await client.post(url, json=body)
    resp.raise_for_status()
    reply = resp.json()
    if reply["choices"][0]["finish_reason"] != "length":
        raise RuntimeError(f"expected a full-length output: {reply['choices'][0]}")
    return int(reply["usage"]["completion_tokens"])


async def block(
    client: httpx.AsyncClient, url: str, model: str, args: argparse.Namespace, constrained: bool
) -> float:
    sem = asyncio.Semaphore(args.max_concurrency)

    async def guarded(prompt: str) -> int:
        async with sem:
            return await one(client, url, model, prompt, args, constrained)

    started = time.perf_counter()
    tokens = await asyncio.gather(*(guarded(p) for p in prompts(args.num_prompts)))
    return sum(tokens) / (time.perf_counter() - started)


async def measure(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        model = (await client.get(f"{base_url}/models")).json()["data"][0]["id"]
        url = f"{base_url}/chat/completions"
        # Warm-up: compiles the schema once (cached afterwards) and warms both paths.
        await asyncio.gather(
            one(client, url, model, "warm up", args, True),
            one(client, url, model, "warm up", args, False),
        )
        free: list[float] = []
        constrained: list[float] = []
        for pair in range(args.blocks):
            for arm in (False, True) if pair % 2 == 0 else (True, False):
                tps = await block(client, url, model, args, constrained=arm)
                (constrained if arm else free).append(tps)
    ratios = [c / f for c, f in zip(constrained, free, strict=True)]
    return {
        "max_concurrency": args.max_concurrency,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "unconstrained_tok_s": round(statistics.median(free), 2),
        "json_schema_tok_s": round(statistics.median(constrained), 2),
        "ratio": round(statistics.median(ratios), 3),
        "pair_ratios": [round(r, 3) for r in ratios],
        "unconstrained_blocks": [round(x, 2) for x in free],
        "json_schema_blocks": [round(x, 2) for x in constrained],
    }


def run_with_mesh(args: argparse.Namespace) -> dict[str, Any]:
    offset = args.port_offset
    log_dir = Path(tempfile.mkdtemp(prefix="meshllm-bench-so-"))
    env = {
        **os.environ,
        "MESHLLM_NUM_THREADS": str(args.threads),
        "MESHLLM_KV_CACHE_BYTES": str(512 * 2**20),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.launcher",
            "--services",
            "gateway,scheduler,worker,grammar",
            "--port-offset",
            str(offset),
            "--redis-port",
            str(args.redis_port),
            "--log-dir",
            str(log_dir),
        ],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{8000 + offset}/ready", proc, 600)
        wait_http(f"http://127.0.0.1:{8003 + offset}/ready", proc, 600)
        return asyncio.run(measure(f"http://127.0.0.1:{8000 + offset}/v1", args))
    finally:
        stop(proc)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="", help="a running mesh; default: start one")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--blocks", type=int, default=6, help="pairs of blocks (one per arm)")
    p.add_argument("--threads", type=int, default=2, help="worker torch threads")
    p.add_argument("--port-offset", type=int, default=400)
    p.add_argument("--redis-port", type=int, default=16790)
    p.add_argument("--timeout", type=float, default=600.0)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.base_url:
        result = asyncio.run(measure(args.base_url.rstrip("/"), args))
    else:
        result = run_with_mesh(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
