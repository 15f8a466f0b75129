"""Bus round trip against Redis' own: what the bus adds to one stream hop there and back.

Two paths, each with an echo consumer in another process, measured in alternating blocks of 100
round trips so both see the same machine load:

- raw: XADD of pre-encoded bytes -> the echo's XREADGROUP BLOCK -> XADD of a pre-encoded reply
  (then XACK) -> the caller's XREAD BLOCK. redis-py asyncio + hiredis, no codec: the floor.
- bus: `Bus.publish(StepPlan)` -> the echo's `Bus.read_group` (decode) -> `Bus.publish(StepResult)`
  (encode) then `Bus.ack` -> the caller's `Bus.read` (decode). What a scheduler step pays.

The messages are a decode step of a batch of 32: a StepPlan diff for 32 running requests and a
StepResult with one sampled token (and its logprob) each.

    python -m bench.bus_roundtrip [--redis-url URL] [-n 2000] [--json]

Without --redis-url a private redis-server is started (persistence off, loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from redis.asyncio import Redis

from shared.bus import Bus, Delivery
from shared.codec import decode, encode
from shared.protocol import CachedRequestData, SampledTokens, StepPlan, StepResult

BATCH = 32
GROUP = "echo"
MAXLEN = 10_000
BLOCK = 100  # round trips per path before switching to the other


def step_plan(step_id: int) -> StepPlan:
    ids = [f"req-{i}" for i in range(BATCH)]
    return StepPlan(
        step_id=step_id,
        scheduler_id="bench",
        cached_requests=[
            CachedRequestData(request_id=r, new_block_ids=[[]], num_computed_tokens=100 + step_id)
            for r in ids
        ],
        num_scheduled_tokens=dict.fromkeys(ids, 1),
    )


def step_result(step_id: int) -> StepResult:
    return StepResult(
        step_id=step_id,
        worker_id="bench-echo",
        sampled=[
            SampledTokens(request_id=f"req-{i}", token_ids=[1000 + i], logprobs=[-0.5])
            for i in range(BATCH)
        ],
    )


def streams(path: str) -> tuple[str, str]:
    return f"meshllm:bench:{path}:ping", f"meshllm:bench:{path}:pong"


# --- echo consumers (child processes) ---------------------------------------------------------


def echo(path: str, url: str, ready: Any) -> None:
    asyncio.run(echo_bus(url, ready) if path == "bus" else echo_raw(url, ready))


async def echo_raw(url: str, ready: Any) -> None:
    ping, pong = streams("raw")
    reply = {b"m": encode(step_result(0))}
    r = Redis.from_url(url)
    await r.xgroup_create(ping, GROUP, id="0", mkstream=True)
    ready.set()
    while True:
        response: Any = await r.xreadgroup(GROUP, "echo", {ping: ">"}, count=64, block=1000)
        for _, entries in response:
            for entry_id, _fields in entries:
                await r.xadd(pong, reply, maxlen=MAXLEN, approximate=True)  # type: ignore[arg-type]
                await r.xack(ping, GROUP, entry_id)


async def echo_bus(url: str, ready: Any) -> None:
    ping, pong = streams("bus")
    bus = Bus(url, "echo", maxlen=MAXLEN)
    await bus.connect()
    await bus.ensure_group(ping, GROUP)
    template = step_result(0)  # built once: message construction is not the bus's cost
    ready.set()
    while True:
        deliveries = await bus.read_group(GROUP, [ping], block_ms=1000)
        for d in deliveries:
            plan = d.message
            assert isinstance(plan, StepPlan)
            await bus.publish(pong, template.model_copy(update={"step_id": plan.step_id}))
        await bus.ack(GROUP, deliveries)


# --- the caller ---------------------------------------------------------------------------------


@dataclass
class Latency:
    median_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        ms = sorted(s * 1000 for s in seconds)
        p99 = ms[max(0, math.ceil(0.99 * len(ms)) - 1)]
        return cls(statistics.median(ms), p99, statistics.fmean(ms), ms[-1])


class RawCaller:
    """XADD pre-encoded bytes, XREAD the echo's reply: no codec, no bus."""

    def __init__(self, url: str) -> None:
        self.ping, self.pong = streams("raw")
        self.payload = {b"m": encode(step_plan(0))}
        self.redis = Redis.from_url(url)
        self.last = {self.pong: "0"}

    async def round_trip(self, step: int) -> None:
        await self.redis.xadd(self.ping, self.payload, maxlen=MAXLEN, approximate=True)  # type: ignore[arg-type]
        got: Any = []
        while not got:
            got = await self.redis.xread(self.last, count=1, block=1000)  # type: ignore[arg-type]
        self.last[self.pong] = got[0][1][-1][0]


class BusCaller:
    """Publish a StepPlan, read the StepResult back, both through the bus."""

    def __init__(self, url: str, n: int) -> None:
        self.ping, self.pong = streams("bus")
        self.bus = Bus(url, "caller", maxlen=MAXLEN)
        self.last = {self.pong: "0"}
        self.plans = [step_plan(i) for i in range(n)]  # built up front, outside the timings

    async def round_trip(self, step: int) -> None:
        await self.bus.publish(self.ping, self.plans[step])
        replies: list[Delivery] = []
        while not replies:
            replies = await self.bus.read(self.last, count=1, block_ms=1000)
        result = replies[0].message
        if not isinstance(result, StepResult) or result.step_id != step:
            raise RuntimeError(f"echo answered {result!r} to step {step}")


async def measure(url: str, n: int, warmup: int) -> tuple[list[float], list[float]]:
    """Alternate blocks of BLOCK round trips per path: each loop stays hot (as a real step loop
    is), and slow drifts of the machine's load hit both paths alike."""
    raw, bus = RawCaller(url), BusCaller(url, warmup + n)
    times: dict[str, list[float]] = {"raw": [], "bus": []}
    for first in range(0, warmup + n, BLOCK):
        for name, caller in (("raw", raw), ("bus", bus)):
            for step in range(first, min(first + BLOCK, warmup + n)):
                started = time.perf_counter()
                await caller.round_trip(step)
                if step >= warmup:
                    times[name].append(time.perf_counter() - started)
    await raw.redis.aclose()
    await bus.bus.close()
    return times["raw"], times["bus"]


def codec_us(repeats: int = 2000) -> dict[str, float]:
    """In-process encode+decode cost of the two messages, to explain the gap."""
    plan, result = step_plan(1), step_result(1)
    out = {}
    for name, msg in (("step_plan", plan), ("step_result", result)):
        started = time.perf_counter()
        for _ in range(repeats):
            decode(encode(msg))
        out[name] = (time.perf_counter() - started) / repeats * 1e6
    return out


def run(url: str, n: int, warmup: int) -> dict[str, Any]:
    import redis

    with redis.Redis.from_url(url) as r:  # a shared Redis may hold an earlier run's streams
        r.delete(*streams("raw"), *streams("bus"))
    ctx = mp.get_context("spawn")
    echoes = []
    try:
        for path in ("raw", "bus"):
            ready = ctx.Event()
            proc = ctx.Process(target=echo, args=(path, url, ready), daemon=True)
            proc.start()
            echoes.append(proc)
            if not ready.wait(60):
                raise RuntimeError(f"the {path} echo process did not start")
        raw_times, bus_times = asyncio.run(measure(url, n, warmup))
    finally:
        for proc in echoes:
            proc.terminate()
            proc.join(5)
    raw, bus = Latency.of(raw_times), Latency.of(bus_times)
    return {
        "n": n,
        "warmup": warmup,
        "batch": BATCH,
        "bytes": {
            "step_plan": len(encode(step_plan(0))),
            "step_result": len(encode(step_result(0))),
        },
        "raw": asdict(raw),
        "bus": asdict(bus),
        "ratio_median": bus.median_ms / raw.median_ms,
        "ratio_p99": bus.p99_ms / raw.p99_ms,
        "codec_encode_decode_us": codec_us(),
    }


def table(report: dict[str, Any]) -> str:
    raw, bus = report["raw"], report["bus"]
    rows = [
        "| path | median ms | p99 ms | mean ms | max ms |",
        "|---|---:|---:|---:|---:|",
        f"| redis raw (XADD → XREADGROUP → XADD → XREAD) | {raw['median_ms']:.3f} "
        f"| {raw['p99_ms']:.3f} | {raw['mean_ms']:.3f} | {raw['max_ms']:.3f} |",
        f"| meshllm bus (StepPlan → StepResult) | {bus['median_ms']:.3f} "
        f"| {bus['p99_ms']:.3f} | {bus['mean_ms']:.3f} | {bus['max_ms']:.3f} |",
        f"| bus / raw | {report['ratio_median']:.2f}x | {report['ratio_p99']:.2f}x | | |",
    ]
    sizes = report["bytes"]
    codec = report["codec_encode_decode_us"]
    return "\n".join(rows) + (
        f"\n\nn={report['n']} round trips after {report['warmup']} warm-up, batch {report['batch']}"
        f"; StepPlan {sizes['step_plan']} B, StepResult {sizes['step_result']} B; "
        f"encode+decode {codec['step_plan']:.0f} µs (plan), {codec['step_result']:.0f} µs "
        "(result) in-process."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="", help="default: start a private redis-server")
    parser.add_argument("-n", type=int, default=2000, help="measured round trips per path")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    from tests.support.redis_server import redis_url_or_private

    with redis_url_or_private(args.redis_url) as url:
        report = run(url, args.n, args.warmup)
    print(json.dumps(report, indent=2) if args.json else table(report))


if __name__ == "__main__":
    main()
