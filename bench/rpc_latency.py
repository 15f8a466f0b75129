"""Call latency between services: a kvstore lookup (on the scheduler's path, per step with new
prompt blocks) and a cached grammar compile (the gateway's, per constrained request), median and
p99, through the real client objects against the real services.

The kvstore and grammar services run as processes on a private Redis (tests/support/mesh.py);
the clients run here, as the scheduler and the gateway hold them: `KVStoreClient.lookup` with
1 and 96 keys (one block, and a ~1,500-token prompt's chunks), `GrammarClient.compile` of a
JSON schema already compiled (a memory hit in the service, plus its Redis TTL refresh). The
three calls alternate in blocks of 50 after a warm-up, so machine-load drifts hit them alike.
Besides wall-clock latency, each call's CPU time is reported, summed over the three processes
it runs in (this client, the callee service, redis-server): on a loaded machine the latency
mostly measures the wait for a core, the CPU time what each transport costs.

The transport is the tree's own: over the bus (shared.rpc) where the tree has it, else the HTTP
APIs the bus replaced (`/v1/kv/lookup`, `/v1/grammars/compile`: trees up to 1994aba). To
compare the two, run this same file on both trees, alternating:

    git worktree add /tmp/base 1994aba && cp bench/rpc_latency.py /tmp/base/bench/
    (cd /tmp/base && python -m bench.rpc_latency); python -m bench.rpc_latency   # repeat

    python -m bench.rpc_latency [-n 2000] [--warmup 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.kv.offload_key import OffloadKey
from shared.protocol import GrammarRef
from tests.support.mesh import Mesh

MODEL = "bench-model"
LOOKUP_SIZES = (1, 96)
BLOCK = 50  # calls of one kind before switching to the next
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)
ENV = {"MESHLLM_LOG_LEVEL": "WARNING", "MESHLLM_COMPILE_WORKERS": "1"}

Call = Callable[[], Awaitable[Any]]


@dataclass
class Latency:
    median_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    cpu_ms: float  # CPU per call: client + callee + redis-server

    @classmethod
    def of(cls, seconds: list[float], cpu_s: float) -> Latency:
        ms = sorted(s * 1000 for s in seconds)
        p99 = ms[max(0, math.ceil(0.99 * len(ms)) - 1)]
        return cls(statistics.median(ms), p99, statistics.fmean(ms), ms[-1], cpu_s * 1000 / len(ms))


def process_cpu_s(pid: int) -> float:
    """utime + stime of another process (clock ticks: summed over many blocks, the rounding
    of each reading averages out)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def keys(n: int, seed: int) -> list[OffloadKey]:
    return [OffloadKey(((seed << 32) + i).to_bytes(16, "little"), 0) for i in range(n)]


async def bus_calls(mesh: Mesh, stack: AsyncExitStack) -> dict[str, Call]:
    """The bus clients: a scheduler's KVStoreClient and a gateway's GrammarClient, each on its
    own bus and reply stream (as in their processes)."""
    from services.gateway.plan.grammar_client import GrammarClient
    from services.scheduler.offload.kvstore_client import KVStoreClient
    from shared.bus import Bus
    from shared.rpc import RpcClient
    from shared.streams import Streams

    streams = Streams(mesh.cluster)
    rpcs = {}
    for service in ("scheduler", "gateway"):
        bus = Bus(mesh.redis.url, f"bench-{service}")
        await bus.connect()
        stack.push_async_callback(bus.close)
        rpc = RpcClient(bus, streams.rpc_replies(service, "bench"), streams.rpc_reply_prefix)
        await rpc.start()
        stack.push_async_callback(rpc.stop)
        rpcs[service] = rpc
    kv = KVStoreClient(rpcs["scheduler"], streams.calls("kvstore"), MODEL, timeout_s=5)
    grammars = GrammarClient(rpcs["gateway"], streams.calls("grammar"), 30)
    return calls_of(kv, grammars)


async def http_calls(mesh: Mesh, stack: AsyncExitStack) -> dict[str, Call]:
    """The HTTP clients of a tree from before the bus calls (their constructors took URLs)."""
    from services.gateway.plan.grammar_client import GrammarClient
    from services.scheduler.offload.kvstore_client import KVStoreClient

    kv = KVStoreClient(mesh.url("kvstore"), MODEL, timeout_s=5)  # type: ignore[arg-type,call-arg]
    stack.push_async_callback(kv.aclose)  # type: ignore[attr-defined]
    grammars = GrammarClient(mesh.url("grammar"), 30)  # type: ignore[arg-type,call-arg]
    stack.push_async_callback(grammars.close)  # type: ignore[attr-defined]
    return calls_of(kv, grammars)


def calls_of(kv: Any, grammars: Any) -> dict[str, Call]:
    ref = GrammarRef(kind="json_schema", spec=SCHEMA)
    out: dict[str, Call] = {
        f"kvstore lookup, {n} key{'s' if n > 1 else ''}": (
            lambda batch=keys(n, n): kv.lookup(batch)  # type: ignore[misc]
        )
        for n in LOOKUP_SIZES
    }
    out["grammar compile, cached"] = lambda: grammars.compile(ref, "response_format")
    return out


async def measure(mesh: Mesh, n: int, warmup: int) -> tuple[str, dict[str, Latency]]:
    async with AsyncExitStack() as stack:
        try:
            import shared.rpc  # noqa: F401

            transport, calls = "bus", await bus_calls(mesh, stack)
        except ImportError:
            transport, calls = "http", await http_calls(mesh, stack)
        for call in calls.values():  # connections opened, the schema compiled, code paths hot
            for _ in range(warmup):
                await call()
        assert mesh.redis.proc is not None
        redis_pid = mesh.redis.proc.pid
        callee = {name: mesh.procs[name.split()[0]].pid for name in calls}
        times: dict[str, list[float]] = {name: [] for name in calls}
        cpu: dict[str, float] = dict.fromkeys(calls, 0.0)
        for first in range(warmup, warmup + n, BLOCK):  # warm-up: the first blocks, dropped
            for name, call in calls.items():
                pids = (callee[name], redis_pid)
                cpu_before = time.process_time() + sum(map(process_cpu_s, pids))
                for _ in range(first, min(first + BLOCK, warmup + n)):
                    started = time.perf_counter()
                    await call()
                    times[name].append(time.perf_counter() - started)
                cpu[name] += time.process_time() + sum(map(process_cpu_s, pids)) - cpu_before
        return transport, {name: Latency.of(t, cpu[name]) for name, t in times.items()}


def tree_commit() -> str:
    """The tree's commit, `+` when its tracked files differ from it."""
    repo = str(Path(__file__).resolve().parents[1])
    try:
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "diff", "--quiet", "HEAD"]).returncode != 0
    except OSError:
        return "unknown"
    return f"{head}{'+' if dirty else ''}" or "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-n", type=int, default=2000, help="measured calls per kind")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    env = {**ENV, "MESHLLM_MODEL_CACHE_DIR": os.environ.get("MESHLLM_MODEL_CACHE_DIR", "")}
    env = {k: v for k, v in env.items() if v}
    with Mesh(services=("kvstore", "grammar"), env=env) as mesh:
        transport, results = asyncio.run(measure(mesh, args.n, args.warmup))
    report = {
        "tree": tree_commit(),
        "transport": transport,
        "n": args.n,
        "warmup": args.warmup,
        "calls": {name: asdict(lat) for name, lat in results.items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"tree {report['tree']}, transport {transport}, n={args.n} after {args.warmup} warm-up")
    print("| call | median ms | p99 ms | mean ms | max ms | CPU ms/call |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, lat in results.items():
        print(
            f"| {name} | {lat.median_ms:.3f} | {lat.p99_ms:.3f} | {lat.mean_ms:.3f} "
            f"| {lat.max_ms:.3f} | {lat.cpu_ms:.3f} |"
        )


if __name__ == "__main__":
    main()
