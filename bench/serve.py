"""Serving benchmark: drive a running OpenAI-compatible server (the mesh's gateway, vLLM, ...)
the way `vllm bench serve` does, and report the same metrics under the same names.

Requests are streaming `/v1/completions` with token-id prompts, greedy, a fixed output length
(ignore_eos) and `stream_options.include_usage`, so every engine is charged the same tokens.
They arrive at `--request-rate` per second (a gamma process of shape `--burstiness`; 1 is
Poisson, inf sends all at once) with at most `--max-concurrency` in flight.

Datasets:
- `random`: `--input-len` random token ids per prompt (lengths drawn in
  [input-len * (1 - range-ratio), input-len * (1 + range-ratio)]), never repeated;
- `shared-prefix`: `--num-prefixes` random prefixes of `--prefix-len` tokens, each prompt one of
  them (round robin) followed by `--input-len` tokens of its own: the prefix-cache case.

Reported: completed/failed requests, request and output throughput, and TTFT, TPOT (time per
output token after the first), ITL (gap between streamed chunks) and E2E latency, each as
mean, median, std and the `--percentiles` asked for (p50, p99 by default), in ms. With
`--goodput ttft:2000 tpot:50` (ms; keys ttft, tpot, e2el, as vllm bench serve), also
`request_goodput`: requests per second that met every one of those objectives.

    python -m bench.serve --num-prompts 64 --max-concurrency 8 --input-len 256 --output-len 128
    python -m bench.serve --dataset shared-prefix --prefix-len 512 --num-prefixes 4 \
        --input-len 64 --request-rate 4 --num-prompts 100
    python -m bench.serve --help

`--num-warmups N` sends N requests of prompts outside the dataset first (never the measured
prompts: that would hand the timed run a prefix-cache hit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# The lowest ids are special/control tokens in most vocabularies: random prompts skip them.
FIRST_PLAIN_TOKEN = 200


@dataclass
class RequestRecord:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]


def random_prompts(
    n: int, input_len: int, vocab: int, seed: int | str, range_ratio: float = 0.0
) -> list[list[int]]:
    rng = random.Random(seed)
    low = max(1, round(input_len * (1 - range_ratio)))
    high = max(low, round(input_len * (1 + range_ratio)))
    return [_tokens(rng, rng.randint(low, high), vocab) for _ in range(n)]


def shared_prefix_prompts(
    n: int, prefix_len: int, num_prefixes: int, suffix_len: int, vocab: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + _tokens(rng, suffix_len, vocab) for i in range(n)]


def dataset(args: argparse.Namespace, n: int, seed: int) -> list[list[int]]:
    if args.dataset == "shared-prefix":
        return shared_prefix_prompts(
            n, args.prefix_len, args.num_prefixes, args.input_len, args.vocab, seed
        )
    return random_prompts(n, args.input_len, args.vocab, seed, args.range_ratio)


async def arrivals(n: int, rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Yields 0..n-1, each after a gamma-distributed gap of mean 1/rate (as vllm bench serve)."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> RequestRecord:
    rec = RequestRecord()
    start = time.perf_counter()
    last = start
    chunks = 0
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
                if chunks == 0:
                    rec.ttft = now - start
                else:
                    rec.itl.append(now - last)
                chunks += 1
                last = now
        rec.e2el = time.perf_counter() - start
        rec.ok = rec.output_tokens > 0
        if not rec.ok:
            rec.error = "no usage in the stream (stream_options.include_usage)"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def _stats(values: list[float], name: str, percentiles: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values) or [0.0]
    out = {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"std_{name}_ms": statistics.pstdev(ms),
    }
    for p in percentiles:
        index = min(len(ms) - 1, max(0, round(p / 100 * (len(ms) - 1))))
        out[f"p{p:g}_{name}_ms"] = ms[index]
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """One benchmark run against `args.base_url`; the metrics of `vllm bench serve`."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model
        if not model:
            model = (await client.get(f"{base}/models", headers=headers)).json()["data"][0]["id"]
        url = f"{base}/completions"
        in_flight = asyncio.Semaphore(args.max_concurrency or args.num_prompts or 1)

        async def send(prompt: list[int]) -> RequestRecord:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with in_flight:
                return await _one(client, url, body, headers)

        if args.num_warmups:
            # A seed no measured prompt is drawn from: warm-up blocks must not be cache hits.
            warm = dataset(args, args.num_warmups, args.seed + 1_000_003)
            await asyncio.gather(*(send(p) for p in warm))
        prompts = dataset(args, args.num_prompts, args.seed)
        tasks = []
        started = time.perf_counter()
        async for i in arrivals(len(prompts), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(send(prompts[i])))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started

    done = [r for r in records if r.ok]
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    result: dict[str, Any] = {
        "dataset": args.dataset,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    result |= _stats([r.ttft for r in done], "ttft", percentiles)
    result |= _stats(tpots, "tpot", percentiles)
    result |= _stats([x for r in done for x in r.itl], "itl", percentiles)
    result |= _stats([r.e2el for r in done], "e2el", percentiles)
    if args.goodput:
        slo = parse_goodput(args.goodput)
        good = [r for r in done if meets(r, slo)]
        result["goodput_slo_ms"] = slo
        result["request_goodput"] = len(good) / duration
        result["good_requests"] = len(good)
    errors = [r.error for r in records if not r.ok][:3]
    if errors:
        result["errors"] = errors
    return result


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """`["ttft:2000", "tpot:50"]` -> {"ttft": 2000.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for pair in pairs:
        key, _, value = pair.partition(":")
        if key not in GOODPUT_KEYS or not value:
            raise SystemExit(f"--goodput {pair!r}: expected KEY:MS with KEY in {GOODPUT_KEYS}")
        slo[key] = float(value)
    return slo


def meets(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether one finished request met every objective (TPOT over its tokens after the first,
    as vllm bench serve's goodput counts it)."""
    tpot = (rec.e2el - rec.ttft) / (rec.output_tokens - 1) if rec.output_tokens > 1 else 0.0
    measured = {"ttft": rec.ttft, "tpot": tpot, "e2el": rec.e2el}
    return all(measured[key] * 1000 <= limit for key, limit in slo.items())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="", help="default: the first of GET /models")
    p.add_argument("--api-key", default="")
    p.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256, help="tokens (after the prefix)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: input length spread")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=0, help="0 = unbounded")
    p.add_argument("--percentiles", default="50,99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--goodput", nargs="+", default=[], help="SLOs in ms, e.g. ttft:2000 tpot:50")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default="", help="also write the JSON result here")
    return p


def main() -> None:
    args = parser().parse_args()
    result = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>26}: {value:.3f}" if isinstance(value, float) else f"{key:>26}: {value}")


if __name__ == "__main__":
    main()
