"""Soak: the whole mesh under mixed load for a long time, every process's RSS sampled.

Starts all five services on a private redis-server with ACLs and the KV tier on (tests/support/
mesh.py), then keeps `--concurrency` clients busy for `--minutes` with a rotating mix of what
users send: streamed and plain chat, completions, n=2, seeded sampling, JSON-object and choice
structured outputs, repeated long system prompts (prefix cache and tier hits), requests the
client abandons mid-stream, and malformed bodies (each must be a 4xx). Every `--sample-s`
seconds it records the RSS of each service process (and of its children: the gateway's
planning processes) and of redis-server.

Prints a table per service: RSS at the end of the warm-up (`--warmup-min`), at the end, the
growth between, and the slope of a least-squares line over the samples after warm-up (MiB per
hour), plus request counts by outcome. Rows `(redis used_memory)` and `(redis used_memory_rss)`
are redis-server's own accounting (data against RSS: fragmentation shows as the gap), and at
the end the largest key patterns by MEMORY USAGE. Two more rows split the worker's RSS: the
payload bytes its host-memory KV tier holds (`meshllm:worker_kv_host_tier_bytes`, an LRU that
grows to `MESHLLM_KV_HOST_TIER_BYTES`), and the rest. A service that leaks shows a steady
slope; one that settles shows the warm-up growth and a flat line after it.

    python -m bench.soak --minutes 60 --concurrency 4 [--csv rss.csv] [--env KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import time
from pathlib import Path

import httpx
import openai

from tests.support.mesh import SERVICES, Mesh

SYSTEM_PROMPTS = [
    f"You are assistant number {i}. " + "Answer briefly, plainly and politely. " * 40
    for i in range(6)
]
TOPICS = ["rivers", "bread", "chess", "clouds", "bicycles", "owls", "tea", "glass"]


def rss_mib(pid: int) -> float:
    """RSS of `pid` and its descendants, MiB (0 when gone)."""
    total = 0
    pending = [pid]
    while pending:
        p = pending.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                pending.extend(int(c) for c in children)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1024


def processes(mesh: Mesh) -> dict[str, int]:
    pids = {name: proc.pid for name, proc in mesh.procs.items() if proc.poll() is None}
    if mesh.redis.proc is not None:
        pids["redis-server"] = mesh.redis.proc.pid
    return pids


async def one_request(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, model: str, i: int
) -> str:
    kind = i % 9
    topic = random.choice(TOPICS)
    system = {"role": "system", "content": random.choice(SYSTEM_PROMPTS)}
    user = {"role": "user", "content": f"Tell me about {topic}. ({i})"}
    if kind == 0:  # streamed chat with a shared system prompt
        stream = await client.chat.completions.create(
            model=model, messages=[system, user], max_tokens=48, stream=True
        )
        async for _ in stream:
            pass
    elif kind == 1:  # plain chat, seeded sampling
        await client.chat.completions.create(
            model=model, messages=[user], max_tokens=32, temperature=0.8, seed=i
        )
    elif kind == 2:  # completions, n=2
        await client.completions.create(
            model=model, prompt=f"A note on {topic}:", max_tokens=24, n=2, temperature=1.0
        )
    elif kind == 3:  # JSON object
        await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"JSON about {topic}"}],
            max_tokens=32,
            response_format={"type": "json_object"},
        )
    elif kind == 4:  # choice
        await client.chat.completions.create(
            model=model,
            messages=[user],
            max_tokens=8,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        )
    elif kind == 5:  # abandoned mid-stream
        stream = await client.chat.completions.create(
            model=model, messages=[system, user], max_tokens=200, stream=True
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= 4:
                break
        await stream.close()
        return "abandoned"
    elif kind == 6:  # malformed body: must be a 4xx
        resp = await http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [')
        return "rejected" if 400 <= resp.status_code < 500 else f"bad status {resp.status_code}"
    elif kind == 7:  # long prompt, streamed completions
        stream = await client.completions.create(
            model=model, prompt=random.choice(SYSTEM_PROMPTS) + topic, max_tokens=64, stream=True
        )
        async for _ in stream:
            pass
    else:  # unknown model: 404
        try:
            await client.chat.completions.create(model="nope", messages=[user], max_tokens=4)
        except openai.NotFoundError:
            return "rejected"
        return "bad status 200"
    return "completed"


def redis_memory_mib(mesh: Mesh) -> dict[str, float]:
    """redis-server's own accounting: bytes its data holds (`used_memory`) against its RSS."""
    info = mesh.admin().info("memory")
    return {key: info[key] / 2**20 for key in ("used_memory", "used_memory_rss")}


def redis_keyspace(mesh: Mesh, top: int = 12) -> list[tuple[str, str, int, int]]:
    """(key pattern, type, keys, bytes by MEMORY USAGE) for the largest patterns: a key's name
    with its ids (hex, digits) replaced by `*`."""
    admin = mesh.admin()
    sizes: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for key in admin.scan_iter(count=1000):
        name = key.decode(errors="replace")
        pattern = re.sub(r"[0-9a-f]{8,}|\d+", "*", name)
        kind = admin.type(key).decode()
        entry = sizes[(pattern, kind)]
        entry[0] += 1
        entry[1] += admin.memory_usage(key) or 0
    ranked = sorted(sizes.items(), key=lambda item: -item[1][1])[:top]
    return [(pattern, kind, n, size) for (pattern, kind), (n, size) in ranked]


def host_tier_mib(mesh: Mesh) -> float:
    """Payload bytes the worker's host-memory KV tier holds, MiB (0 when it cannot say)."""
    try:
        return mesh.metric("worker", "meshllm:worker_kv_host_tier_bytes") / 2**20
    except Exception:  # the worker is restarting: the next sample has it
        return 0.0


async def drive(mesh: Mesh, args: argparse.Namespace, csv: list[str]) -> dict[str, int]:
    client = openai.AsyncOpenAI(base_url=mesh.api, api_key="x", timeout=300, max_retries=0)
    http = httpx.AsyncClient(base_url=mesh.url("gateway"), timeout=60)
    model = (await client.models.list()).data[0].id
    outcomes: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    end = time.monotonic() + args.minutes * 60
    counter = iter(range(10**9))

    async def client_loop() -> None:
        while time.monotonic() < end:
            i = next(counter)
            try:
                outcomes[await one_request(client, http, model, i)] += 1
            except Exception as exc:  # counted, never fatal: the soak reports them
                outcomes[f"error {type(exc).__name__}"] += 1
                if len(errors) < 10:
                    errors.append(f"request {i} (kind {i % 9}): {exc!r}"[:500])

    async def sampler() -> None:
        start = time.monotonic()
        while time.monotonic() < end:
            t = time.monotonic() - start
            rss = {name: (pid, rss_mib(pid)) for name, pid in processes(mesh).items()}
            for name, (pid, mib) in rss.items():
                csv.append(f"{t:.0f},{name},{pid},{mib:.1f}")
            if "worker" in rss:  # its host tier fills to its bound: RSS that is not a leak
                tier = await asyncio.to_thread(host_tier_mib, mesh)
                csv.append(f"{t:.0f},(worker host tier),-,{tier:.1f}")
                csv.append(f"{t:.0f},(worker - host tier),-,{rss['worker'][1] - tier:.1f}")
            for key, mib in (await asyncio.to_thread(redis_memory_mib, mesh)).items():
                csv.append(f"{t:.0f},(redis {key}),-,{mib:.1f}")
            await asyncio.sleep(args.sample_s)

    await asyncio.gather(sampler(), *(client_loop() for _ in range(args.concurrency)))
    await http.aclose()
    await client.close()
    for line in errors:
        print(line)
    if errors:  # what the services logged about them: error lines of each service's log
        for name in mesh.procs:
            lines = [ln for ln in mesh.tail(name, 100_000).splitlines() if '"ERROR"' in ln]
            print(f"{name}: {len(lines)} error lines", *lines[-5:], sep="\n  ")
    return dict(outcomes)


def slope_mib_per_hour(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mt) * (r - mr) for t, r in points) / var * 3600


def report(csv: list[str], warmup_s: float) -> None:
    series: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    pids: dict[str, set[str]] = collections.defaultdict(set)
    for row in csv:
        t, name, pid, rss = row.split(",")
        series[name].append((float(t), float(rss)))
        pids[name].add(pid)
    print(f"{'process':<14} {'RSS @warm-up':>12} {'RSS @end':>9} {'growth':>7} {'MiB/h':>7} pids")
    for name, points in sorted(series.items()):
        after = [p for p in points if p[0] >= warmup_s] or points
        first, last = after[0][1], after[-1][1]
        print(
            f"{name:<14} {first:>12.0f} {last:>9.0f} {last - first:>+7.0f} "
            f"{slope_mib_per_hour(after):>+7.1f} {len(pids[name])}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--warmup-min", type=float, default=10)
    parser.add_argument("--csv", default="")
    parser.add_argument(
        "--ready-timeout", type=float, default=600, help="seconds each service may take to start"
    )
    parser.add_argument(
        "--env", nargs="*", default=[], help="KEY=VALUE settings of every service (override)"
    )
    args = parser.parse_args()
    env = {
        "MESHLLM_DTYPE": "bfloat16",
        "MESHLLM_KV_OFFLOAD": "true",
        "MESHLLM_NUM_THREADS": os.environ.get("MESHLLM_NUM_THREADS", "2"),
        # A KV cache the warm-up touches whole: a larger one's pages are first written over
        # the hour, which reads as RSS growth without being one.
        "MESHLLM_KV_CACHE_BYTES": str(512 * 2**20),
        **dict(item.split("=", 1) for item in args.env),
    }
    csv: list[str] = []
    with Mesh(services=SERVICES, env=env, acl=True, ready_timeout=args.ready_timeout) as mesh:
        started = time.monotonic()
        outcomes = asyncio.run(drive(mesh, args, csv))
        elapsed = time.monotonic() - started
        alive = {name: proc.poll() is None for name, proc in mesh.procs.items()}
        keyspace = redis_keyspace(mesh)
    if args.csv:
        Path(args.csv).write_text("t_s,process,pid,rss_mib\n" + "\n".join(csv) + "\n")
    print(f"{elapsed / 60:.1f} min, outcomes: {json.dumps(outcomes, sort_keys=True)}")
    print(f"alive at the end: {alive}")
    report(csv, args.warmup_min * 60)
    print("\nRedis keys at the end, largest first (pattern, type, keys, MiB):")
    for pattern, kind, n, size in keyspace:
        print(f"  {pattern:<48} {kind:<7} {n:>7} {size / 2**20:>8.1f}")


if __name__ == "__main__":
    main()
