"""KV offload data path: store and load bytes/s of SmolLM2-sized blocks through real Redis.

The worker's own code end to end, without the model: a `KVConnector` over a KV cache shaped
like SmolLM2-135M's (30 layers, 3 KV heads x 64, blocks of 16 tokens; 720 KiB per chunk in
fp32, 360 KiB in bf16), its transfer threads and a redis-server. One transfer of `--chunks`
chunks (96 = a 1,536-token prompt) per round:

- store: `after_forward` (the step thread's share: blocks -> staging) until its KVTransferDone
  (payloads packed, pipelined SETs answered);
- load (Redis): the host tier is empty: pipelined GETs, header checks, staging, then
  `apply_ready_loads` (the copy into the blocks) until KVTransferDone;
- load (host tier): the same chunks again, now served from the worker's host-memory tier.

MB/s counts payload bytes (header + K/V) of the whole transfer over its wall time; medians
over `--rounds`. `memcpy` is one plain copy of the same bytes on the same machine in the same
rounds: the floor every path pays at least once (each pays 2-3 copies plus the socket).

    python -m bench.kv_offload [--redis-url URL] [--chunks 96] [--rounds 7] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import redis
import torch

from services.worker.kv_offload.connector import KVConnector
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import LAYOUT_VERSION
from services.worker.kv_offload.transfer_engine import TransferEngine
from services.worker.runner.kv_cache import KVCache
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.protocol import KVTransfer, KVTransferDone, StepPlan

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16  # SmolLM2-135M
SPACE = KeySpace("bench", "SmolLM2-135M-Instruct", LAYOUT_VERSION)


class Done:
    def __init__(self) -> None:
        self.wake = threading.Event()
        self.connector: KVConnector | None = None

    def wait(self, transfer_id: str) -> KVTransferDone:
        assert self.connector is not None
        while True:
            for done in self.connector.drain_done():
                if done.transfer_id == transfer_id:
                    return done
            if not self.wake.wait(120):
                raise TimeoutError(transfer_id)
            self.wake.clear()


def connector(
    url: str, dtype: torch.dtype, chunks: int, host_bytes: int
) -> tuple[KVConnector, Done]:
    layers = [
        torch.randn(2, 2 * chunks + 1, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)
    ]
    cache = KVCache(layers, 2 * chunks + 1, BLOCK)
    done = Done()
    engine = TransferEngine(url, HostTier(host_bytes), timeout_s=60)
    chunk_bytes = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * layers[0].element_size()
    conn = KVConnector(
        cache,
        engine,
        SPACE,
        worker_id="bench",
        staging_bytes=chunks * chunk_bytes,
        notify=done.wake.set,
    )
    done.connector = conn
    return conn, done


def transfer(tid: str, keys: list[str], blocks: list[int]) -> KVTransfer:
    return KVTransfer(
        transfer_id=tid, request_id="r", keys=keys, groups=[0] * len(keys), block_ids=blocks
    )


def load(
    conn: KVConnector, done: Done, tid: str, keys: list[str], blocks: list[int]
) -> tuple[float, KVTransferDone]:
    t0 = time.perf_counter()
    conn.before_forward(
        StepPlan(step_id=0, scheduler_id="b", kv_loads=[transfer(tid, keys, blocks)])
    )
    while not conn.has_ready_loads():  # woken by the load thread (or a failure message)
        if not done.wake.wait(120):
            raise TimeoutError(tid)
        done.wake.clear()
    conn.apply_ready_loads()
    result = done.wait(tid)
    return time.perf_counter() - t0, result


def run(url: str, chunks: int, rounds: int, dtype: torch.dtype) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    # Host tier large enough for one transfer: the "host" load is served from it.
    conn, done = connector(url, dtype, chunks, host_bytes=4 * 2**30)
    src, dst = list(range(1, chunks + 1)), list(range(chunks + 1, 2 * chunks + 1))
    rows: dict[str, list[float]] = {
        "store": [],
        "store_step": [],
        "load_redis": [],
        "memcpy": [],
        "load_host": [],
    }
    nbytes = 0
    for r in range(rounds):
        keys = [
            SPACE.payload_key(OffloadKey(f"{r}-{i}".encode().ljust(16, b"."), 0))
            for i in range(chunks)
        ]
        plan = StepPlan(step_id=r, scheduler_id="b", kv_stores=[transfer(f"s{r}", keys, src)])
        t0 = time.perf_counter()
        conn.before_forward(plan)
        conn.after_forward(plan)
        rows["store_step"].append(time.perf_counter() - t0)
        stored = done.wait(f"s{r}")
        rows["store"].append(time.perf_counter() - t0)
        assert stored.ok, stored.error
        nbytes = stored.num_bytes
        conn.engine.host_tier.clear()  # the first load must come from Redis
        seconds, loaded = load(conn, done, f"lr{r}", keys, dst)
        assert loaded.ok and loaded.num_bytes == nbytes, loaded.error
        rows["load_redis"].append(seconds)
        seconds, loaded = load(conn, done, f"lh{r}", keys, dst)
        assert loaded.ok, loaded.error
        rows["load_host"].append(seconds)
        client.delete(*keys)
        t0 = time.perf_counter()  # the machine's memcpy floor for the same bytes, this round
        conn.pools[0].buffer[:chunks].clone()
        rows["memcpy"].append(time.perf_counter() - t0)
    for layer in conn.group_layers[0]:
        assert torch.equal(layer[:, dst], layer[:, src])
    conn.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "chunks": chunks,
        "chunk_bytes": nbytes // chunks,
        "transfer_mib": nbytes / 2**20,
        "median_s": med,
        "mb_per_s": {k: nbytes / 1e6 / v for k, v in med.items() if k != "store_step"},
        "chunks_per_s": {k: chunks / v for k, v in med.items() if k != "store_step"},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--redis-url", default="", help="default: start a private redis-server")
    parser.add_argument("--chunks", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (copies)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tests.support.redis_server import redis_url_or_private

    with redis_url_or_private(args.redis_url) as url:
        results = [run(url, args.chunks, args.rounds, getattr(torch, d)) for d in args.dtype]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.chunks} chunks per transfer, median of {args.rounds} rounds")
    print("| dtype | chunk KiB | path | MB/s | chunks/s | ms per transfer |")
    print("|---|---|---|---|---|---|")
    for res in results:
        for path in ("store", "load_redis", "load_host", "memcpy"):
            print(
                f"| {res['dtype']} | {res['chunk_bytes'] / 1024:.0f} | {path} | "
                f"{res['mb_per_s'][path]:.0f} | {res['chunks_per_s'][path]:.0f} | "
                f"{res['median_s'][path] * 1000:.1f} |"
            )
        print(
            f"| {res['dtype']} | | store: step thread (blocks -> staging) | | | "
            f"{res['median_s']['store_step'] * 1000:.1f} |"
        )


if __name__ == "__main__":
    main()
