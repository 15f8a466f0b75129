"""KV offload end to end: gateway, scheduler, worker and kvstore processes on a real Redis, with
SmolLM2.

- A ~1,500-token prompt served twice with the worker restarted in between (its local cache
  empty): the second run loads from Redis (the scheduler's metrics show the hit tokens and the
  bytes), and its greedy output is identical. (TTFT is recorded by bench/kv_offload_ttft.py.)
- After runs, and after a worker killed mid-store (once the kvstore's write deadline passed), no
  payload key exists without its metadata and no metadata without its payload.
- kvstore killed, or the KV keys deleted from Redis: requests still complete, by recompute,
  with a warning metric.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

# The kvstore's deadline for a chunk write runs from the scheduler's `store` call, before the
# prefill's forward: it must exceed a ~1,500-token prefill on a busy 2-core machine.
WRITE_TIMEOUT_S = 60.0
SERVICES = ("gateway", "scheduler", "worker", "kvstore")


@pytest.fixture(scope="module")
def kv_mesh(smollm2_dir) -> Iterator[Mesh]:
    mesh = Mesh(services=SERVICES, env={**E2E_ENV, "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5"})
    mesh.extra_env.update(
        {
            "MESHLLM_KVSTORE_URL": mesh.url("kvstore"),
            "MESHLLM_WRITE_TIMEOUT_S": str(WRITE_TIMEOUT_S),
            "MESHLLM_KVSTORE_RETRY_S": "1.0",
            # A ~1,500-token prefill stores 93 chunks of 737 KB (fp32 SmolLM2) in one transfer.
            "MESHLLM_KV_STAGING_BYTES": str(128 * 2**20),
        }
    )
    with mesh:
        yield mesh


def long_prompt(topic: str, words: int = 840) -> str:
    """~1.8 tokens per word with SmolLM2's tokenizer: ~1,500 tokens."""
    body = " ".join(f"{topic} fact number {i} is worth remembering." for i in range(words // 6))
    return f"Read these notes about {topic}.\n{body}\nSummarize them in one sentence."


def chat(mesh: Mesh, prompt: str, max_tokens: int = 8) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )


def metric(mesh: Mesh, name: str, **labels: str) -> float:
    """Sum of the scheduler's samples of `name` whose labels include `labels`."""
    text = httpx.get(f"{mesh.url('scheduler')}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def kvstore_state(mesh: Mesh) -> dict:
    return mesh.admin_state("kvstore")["kvstore"]


def wait_until(check, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def stores_settled(mesh: Mesh) -> bool:
    state = kvstore_state(mesh)
    return state.get("writing", 0) == 0 and state.get("chunks", 0) > 0


def restart_worker(mesh: Mesh) -> None:
    before = mesh.admin_state("worker")["incarnation"]
    mesh.kill("worker")
    mesh.restart("worker")
    assert mesh.admin_state("worker")["incarnation"] != before
    wait_until(lambda: mesh.admin_state("scheduler")["worker_alive"], what="scheduler sees worker")
    wait_until(
        lambda: (
            mesh.admin_state("scheduler")["worker"]["incarnation"]
            == mesh.admin_state("worker")["incarnation"]
        ),
        what="scheduler adopts the new worker",
    )


def kv_keys(mesh: Mesh) -> tuple[set[str], set[str]]:
    """Suffixes (model:version:group:hash) of every payload key and every metadata key."""
    r = redis.Redis.from_url(mesh.redis.url, decode_responses=True)
    payload_prefix = f"meshllm:{mesh.cluster}:kv:"
    meta_prefix = f"meshllm:{mesh.cluster}:kvmeta:"
    payloads = {k[len(payload_prefix) :] for k in r.scan_iter(payload_prefix + "*", count=1000)}
    metas = {k[len(meta_prefix) :] for k in r.scan_iter(meta_prefix + "*", count=1000)}
    r.close()
    return payloads, metas


def assert_consistent(mesh: Mesh) -> None:
    """Once no write is pending (or past its deadline), payloads and metadata pair up."""
    wait_until(
        lambda: kvstore_state(mesh).get("writing", 0) == 0,
        timeout=WRITE_TIMEOUT_S + 30,
        what="writes settled",
    )
    payloads, metas = kv_keys(mesh)
    assert payloads == metas, (payloads - metas, metas - payloads)


@pytest.fixture(scope="module")
def first_run(kv_mesh: Mesh) -> tuple[str, str]:
    prompt = long_prompt("volcanoes")
    reply = chat(kv_mesh, prompt)
    assert reply.usage is not None and 1300 <= reply.usage.prompt_tokens <= 1800
    wait_until(lambda: stores_settled(kv_mesh), timeout=WRITE_TIMEOUT_S, what="first run stored")
    return prompt, reply.choices[0].message.content or ""


def test_second_run_after_a_worker_restart_loads_from_redis(
    kv_mesh: Mesh, first_run: tuple[str, str]
) -> None:
    prompt, text = first_run
    hits = metric(kv_mesh, "meshllm:external_prefix_cache_hits_total")
    loaded = metric(kv_mesh, "meshllm:kv_offload_loaded_bytes_total")
    restart_worker(kv_mesh)
    reply = chat(kv_mesh, prompt)
    assert reply.choices[0].message.content == text  # greedy output identical
    assert metric(kv_mesh, "meshllm:external_prefix_cache_hits_total") - hits >= 1280
    assert metric(kv_mesh, "meshllm:kv_offload_loaded_bytes_total") > loaded
    assert metric(kv_mesh, "meshllm:kv_offload_stored_bytes_total") > 0
    assert_consistent(kv_mesh)


def test_a_worker_killed_mid_store_leaves_no_half_chunk(kv_mesh: Mesh) -> None:
    prompt = long_prompt("glaciers")
    client = openai.OpenAI(base_url=kv_mesh.api, api_key="x", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    first_token = threading.Event()
    done: list[str] = []

    def stream() -> None:
        out = ""
        for chunk in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                out += chunk.choices[0].delta.content
                first_token.set()
        done.append(out)

    runner = threading.Thread(target=stream)
    runner.start()
    assert first_token.wait(120)  # the prefill ran: its blocks' stores are in flight
    kv_mesh.kill("worker")
    assert_consistent(kv_mesh)  # writes it never reported expire: their payloads are deleted
    restart_worker(kv_mesh)
    runner.join(300)
    assert done and done[0], "the request did not complete after the worker restart"
    assert_consistent(kv_mesh)


def test_kv_keys_deleted_from_redis_fall_back_to_recompute(
    kv_mesh: Mesh, first_run: tuple[str, str]
) -> None:
    prompt, text = first_run
    r = redis.Redis.from_url(kv_mesh.redis.url)
    for pattern in (f"meshllm:{kv_mesh.cluster}:kv:*", f"meshllm:{kv_mesh.cluster}:kvmeta:*"):
        for key in list(r.scan_iter(pattern, count=1000)):
            r.unlink(key)
    r.close()
    restart_worker(kv_mesh)  # no local copy either
    failed = metric(kv_mesh, "meshllm:kv_offload_transfers_total", kind="load", result="failed")
    reply = chat(kv_mesh, prompt)
    assert reply.choices[0].message.content == text
    assert (
        metric(kv_mesh, "meshllm:kv_offload_transfers_total", kind="load", result="failed") > failed
    )


def test_kvstore_killed_requests_still_complete_with_a_warning_metric(
    kv_mesh: Mesh, first_run: tuple[str, str]
) -> None:
    prompt, text = first_run
    errors = metric(kv_mesh, "meshllm:kv_offload_errors_total")
    kv_mesh.kill("kvstore")
    try:
        restart_worker(kv_mesh)
        reply = chat(kv_mesh, prompt)
        assert reply.choices[0].message.content == text
        assert metric(kv_mesh, "meshllm:kv_offload_errors_total") > errors
    finally:
        kv_mesh.restart("kvstore")
