"""Load generator for any OpenAI-compatible server (the mesh, vLLM, ...).

Sends `--num-prompts` streaming completions with at most `--max-concurrency` in flight, fixed
output length (ignore_eos), random or given prompts, and reports request/output throughput,
TTFT, TPOT, ITL and E2E latency (mean, median, p99) under the field names of `vllm bench serve`,
so one run can put the mesh and another engine side by side.

    python -m bench.serve --base-url http://127.0.0.1:8000/v1 --num-prompts 32 \
        --max-concurrency 8 --input-len 32 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestRecord:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _percentiles(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {f"mean_{prefix}_ms": 0.0, f"median_{prefix}_ms": 0.0, f"p99_{prefix}_ms": 0.0}
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms),
        f"median_{prefix}_ms": statistics.median(ms),
        f"std_{prefix}_ms": statistics.pstdev(ms),
        f"p99_{prefix}_ms": p99,
    }


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int] | str,
    output_len: int,
    headers: dict[str, str],
) -> RequestRecord:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rec = RequestRecord()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if rec.ttft == 0.0:
                    rec.ttft = now - start
                else:
                    rec.itl.append(now - last)
                last = now
        rec.e2el = time.perf_counter() - start
        rec.ok = rec.output_tokens > 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids: special/control tokens of most vocabularies live there.
    return [[rng.randrange(200, vocab) for _ in range(input_len)] for _ in range(n)]


async def run(args: argparse.Namespace) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        model = args.model
        if not model:
            models = (await client.get(f"{base}/models", headers=headers)).json()
            model = models["data"][0]["id"]
        if args.prompt:
            prompts: list[list[int] | str] = [args.prompt] * args.num_prompts
        else:
            prompts = list(random_prompts(args.num_prompts, args.input_len, args.vocab, args.seed))
        sem = asyncio.Semaphore(args.max_concurrency)
        url = f"{base}/completions"

        async def guarded(p: list[int] | str) -> RequestRecord:
            async with sem:
                return await _one(client, url, model, p, args.output_len, headers)

        if args.warmup:
            await asyncio.gather(*(guarded(p) for p in prompts[: args.max_concurrency]))
        t0 = time.perf_counter()
        records = await asyncio.gather(*(guarded(p) for p in prompts))
        duration = time.perf_counter() - t0

    done = [r for r in records if r.ok]
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    result: dict[str, float] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_concurrency": args.max_concurrency,
    }
    result |= _percentiles([r.ttft for r in done], "ttft")
    result |= _percentiles(tpots, "tpot")
    result |= _percentiles([x for r in done for x in r.itl], "itl")
    result |= _percentiles([r.e2el for r in done], "e2el")
    errors = [r.error for r in records if not r.ok][:3]
    if errors:
        result["errors"] = errors  # type: ignore[assignment]
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="")
    p.add_argument("--api-key", default="")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prompt", default="", help="use this text for every request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--json", action="store_true")
    return p


def main() -> None:
    args = parser().parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
