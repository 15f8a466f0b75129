"""KV offload tier: time to first token of a prompt loaded from Redis vs computed.

Through the real mesh on CPU (gateway, scheduler, worker, kvstore as processes on a private
redis-server; SmolLM2-135M-Instruct in fp32 unless `--dtype`; MESHLLM_NUM_THREADS=2 by default;
the default store policy, "reuse"). Per prompt size:
1. first run: a prompt no cache has seen (a unique topic opens it) is prefilled (the TTFT of
   recompute); seen once, nothing of it is stored;
2. the same prompt again: a local prefix hit, and its second sight: its blocks are stored to
   Redis after the step; the worker's store bytes and seconds are read from its metrics
   (`meshllm:worker_kv_transfer_{bytes,seconds}_total{kind="store"}`);
3. the worker is killed and restarted: its local KV (and host tier) are empty, the scheduler
   drops its prefix cache;
4. the prompt once more: the scheduler finds the chunks in the kvstore, the worker loads them
   from Redis, only the last partial block and the new tokens are computed; load bytes and
   seconds from the new worker's metrics, the hit tokens from the scheduler's.
TTFT is measured by the client: request sent -> first streamed content chunk (max_tokens=2).
Store/load MB/s: payload bytes over the transfer's wall time (submitted -> answered).

    python -m bench.kv_offload_ttft [--sizes 512 1024 2048] [--threads 2] [--rounds 1]
    python -m bench.kv_offload_ttft --sizes 2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

import openai

from tests.support.mesh import Mesh

SERVICES = ("gateway", "scheduler", "worker", "kvstore")


def prompt_of(tokens: int, tag: str) -> str:
    """About `tokens` tokens in the chat template with SmolLM2's tokenizer (~2.95 per word of
    this text, measured)."""
    words = int(tokens / 2.95)
    body = " ".join(f"{tag} note {i} is worth keeping." for i in range(max(1, words // 6)))
    return f"{tag}: read these notes.\n{body}\nSummarize them."


def transfer_totals(mesh: Mesh, kind: str) -> tuple[float, float]:
    return (
        mesh.metric("worker", "meshllm:worker_kv_transfer_bytes_total", kind=kind),
        mesh.metric("worker", "meshllm:worker_kv_transfer_seconds_total", kind=kind),
    )


def ttft(mesh: Mesh, prompt: str) -> tuple[float, int, str]:
    """(seconds to the first content chunk, prompt tokens, text) of a greedy streamed run."""
    client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    t0 = time.perf_counter()
    first = None
    text = ""
    usage = 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage.prompt_tokens
    assert first is not None, "no content streamed"
    return first, usage, text


def wait_settled(mesh: Mesh, timeout: float = 120) -> None:
    """Until the kvstore has no chunk being written (the first run's stores were answered)."""
    deadline = time.monotonic() + timeout
    while mesh.admin_state("kvstore")["kvstore"].get("writing", 0):
        if time.monotonic() > deadline:
            raise TimeoutError("stores never settled")
        time.sleep(0.1)


def restart_worker(mesh: Mesh) -> None:
    mesh.kill("worker")
    mesh.restart("worker")
    incarnation = mesh.admin_state("worker")["incarnation"]
    deadline = time.monotonic() + 120
    while True:
        state = mesh.admin_state("scheduler")
        if state["worker_alive"] and state["worker"]["incarnation"] == incarnation:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the scheduler never adopted the restarted worker")
        time.sleep(0.1)


def run_size(mesh: Mesh, size: int) -> dict[str, float]:
    prompt = prompt_of(size, f"topic-{uuid.uuid4().hex[:8]}")
    hits0 = mesh.metric("scheduler", "meshllm:external_prefix_cache_hits_total")
    stored0 = transfer_totals(mesh, "store")
    first_s, prompt_tokens, first_text = ttft(mesh, prompt)
    ttft(mesh, prompt)  # its second sight: stored
    wait_settled(mesh)
    stored = [a - b for a, b in zip(transfer_totals(mesh, "store"), stored0, strict=True)]
    restart_worker(mesh)
    second_s, _, second_text = ttft(mesh, prompt)
    loaded = transfer_totals(mesh, "load")  # the new worker's counters start at 0
    hits = mesh.metric("scheduler", "meshllm:external_prefix_cache_hits_total") - hits0
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_first_ms": 1000 * first_s,
        "ttft_second_ms": 1000 * second_s,
        "speedup": first_s / second_s,
        "hit_tokens": hits,
        "same_text": float(first_text == second_text),
        "store_mb": stored[0] / 1e6,
        "store_mb_s": stored[0] / 1e6 / stored[1] if stored[1] else 0.0,
        "load_mb": loaded[0] / 1e6,
        "load_mb_s": loaded[0] / 1e6 / loaded[1] if loaded[1] else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="runs per size (median)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    env = {
        "MESHLLM_DTYPE": args.dtype,
        "MESHLLM_NUM_THREADS": str(args.threads),
        "MESHLLM_KV_CACHE_BYTES": str(512 * 2**20),
        "MESHLLM_MAX_MODEL_LEN": "4096",
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_KV_OFFLOAD": "true",
        # A 2k-token fp32 prompt's KV (~92 MB) stored whole: the default staging is 64 MiB.
        "MESHLLM_KV_STAGING_BYTES": str(256 * 2**20),
    }
    mesh = Mesh(services=SERVICES, env=env)
    rows = []
    with mesh:
        ttft(mesh, prompt_of(64, "warm-up"))  # first-request costs (tokenizer, template) out
        for size in args.sizes:
            runs = [run_size(mesh, size) for _ in range(args.rounds)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append({"size": size, **row})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nload average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs\n")
    print(
        "| prompt tokens | TTFT 1st run (ms) | TTFT 2nd run, from Redis (ms) | speedup "
        "| hit tokens | same text | store MB @ MB/s | load MB @ MB/s |"
    )
    print("|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['prompt_tokens']:.0f} | {r['ttft_first_ms']:.0f} | {r['ttft_second_ms']:.0f} "
            f"| {r['speedup']:.1f}x | {r['hit_tokens']:.0f} | {'yes' if r['same_text'] else 'NO'} "
            f"| {r['store_mb']:.0f} @ {r['store_mb_s']:.0f} | {r['load_mb']:.0f} @ "
            f"{r['load_mb_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
