"""KV offload end to end: gateway, scheduler, worker and kvstore processes on a real Redis, with
SmolLM2, under the default store policy ("reuse": a chunk is stored once a second request
offers it).

- A ~1,500-token prompt served twice (stored at its second sight) and then once more with the
  worker restarted in between (its local cache empty): the last run loads from Redis (the
  scheduler's metrics show the hit tokens and the bytes), and its greedy output is identical.
  (TTFT is recorded by bench/kv_offload_ttft.py.)
- Prompts seen once are not stored at all.
- A burst of requests sharing a long prefix computes it once (the scheduler's prefix-cache hits)
  and stores it once (no request's own suffix), with the outputs of sequential runs.
- After runs, and after a worker killed mid-store (once the kvstore's write deadline passed), no
  payload key exists without its metadata and no metadata without its payload.
- kvstore killed, or the KV keys deleted from Redis: requests still complete, by recompute,
  with a warning metric.

One mesh and ONE worker restart for the module (a worker start is most of its time): the
`history` fixture serves a short and a long prompt (twice each), kills the worker in the middle
of a request's stores, restarts it and lets that request finish; the tests then work on the
restarted worker, whose local prefix cache is empty.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis

from shared.kv.block_hash import extend_block_hashes
from shared.kv.offload_key import LAYOUT_VERSION, KeySpace, OffloadKey
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

# The kvstore's write deadline runs from the end of the step that computed the chunks (the
# scheduler's `writing` call), so it only has to cover the writes: a ~1,500-token prefill takes
# longer than this on a busy 2-core machine, and its chunks must still be stored.
WRITE_TIMEOUT_S = 4.0
SERVICES = ("gateway", "scheduler", "worker", "kvstore")


@pytest.fixture(scope="module")
def kv_mesh(smollm2_dir) -> Iterator[Mesh]:
    env = {
        **E2E_ENV,
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_OVERLAP_STEPS": "auto",  # the default CPU step loop (no overlap)
        "MESHLLM_KV_OFFLOAD": "true",
        "MESHLLM_WRITE_TIMEOUT_S": str(WRITE_TIMEOUT_S),
        "MESHLLM_KVSTORE_RETRY_S": "1.0",
    }
    with Mesh(services=SERVICES, env=env) as mesh:
        yield mesh


def long_prompt(topic: str, words: int = 840) -> str:
    """~1.8 tokens per word with SmolLM2's tokenizer: 840 words ~ 1,500 tokens."""
    body = " ".join(f"{topic} fact number {i} is worth remembering." for i in range(words // 6))
    return f"Read these notes about {topic}.\n{body}\nSummarize them in one sentence."


def client_of(mesh: Mesh) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=300)
    return client, client.models.list().data[0].id


def chat(mesh: Mesh, prompt: str, max_tokens: int = 8) -> openai.types.chat.ChatCompletion:
    client, model = client_of(mesh)
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )


def metric(mesh: Mesh, name: str, **labels: str) -> float:
    """The scheduler's samples of `name` (see Mesh.metric)."""
    return mesh.metric("scheduler", name, **labels)


def kvstore_state(mesh: Mesh) -> dict:
    return mesh.admin_state("kvstore")["kvstore"]


def wait_until(check, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def worker_adopted(mesh: Mesh, incarnation: str) -> bool:
    state = mesh.admin_state("scheduler")
    return bool(state["worker_alive"]) and state["worker"]["incarnation"] == incarnation


def kv_keys(mesh: Mesh) -> tuple[set[str], set[str]]:
    """Suffixes (model:version:group:hash) of every payload key and every metadata key."""
    r = redis.Redis.from_url(mesh.redis.url, decode_responses=True)
    payload_prefix = f"meshllm:{mesh.cluster}:kv:"
    meta_prefix = f"meshllm:{mesh.cluster}:kvmeta:"
    payloads = {k[len(payload_prefix) :] for k in r.scan_iter(payload_prefix + "*", count=1000)}
    metas = {k[len(meta_prefix) :] for k in r.scan_iter(meta_prefix + "*", count=1000)}
    r.close()
    return payloads, metas


def assert_consistent(mesh: Mesh) -> int:
    """Once no write is pending (done, failed or past its deadline), payloads and metadata pair
    up; returns how many chunks there are."""
    wait_until(
        lambda: kvstore_state(mesh).get("writing", 0) == 0,
        timeout=WRITE_TIMEOUT_S + 30,
        what="writes settled",
    )
    payloads, metas = kv_keys(mesh)
    assert payloads == metas, (payloads - metas, metas - payloads)
    return len(payloads)


@dataclass
class History:
    short_prompt: str
    short_text: str
    long_prompt: str
    long_text: str
    chunks_after_runs: int
    chunks_after_kill: int
    killed_request_text: str


def kill_worker_mid_store(mesh: Mesh, prompt: str) -> tuple[int, str]:
    """Stream `prompt` (seen once before: this second sight stores it); on its first token (its
    first step ran: its stores are being written) kill the worker; once the writes it never
    reported expired, check the keys, restart the worker and let the request finish on it.
    Returns the chunk count after the kill and the text."""
    chat(mesh, prompt, max_tokens=1)
    client, model = client_of(mesh)
    first_token = threading.Event()
    done: list[str] = []

    def stream() -> None:
        out = ""
        for chunk in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
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
    try:
        assert first_token.wait(120), "no first token"
        mesh.kill("worker")
        mesh.start_service("worker")  # loads its model meanwhile; serves once ready
        chunks = assert_consistent(mesh)  # unreported writes expire: their payloads go too
        mesh.wait_ready("worker")
        incarnation = mesh.admin_state("worker")["incarnation"]
        wait_until(lambda: worker_adopted(mesh, incarnation), what="scheduler adopts the worker")
        mesh.wait_serving()
    finally:
        runner.join(300)
    assert done and done[0], "the request did not complete after the worker restart"
    return chunks, done[0]


@pytest.fixture(scope="module")
def history(kv_mesh: Mesh) -> History:
    short_prompt = long_prompt("rivers", words=150)  # ~300 tokens
    short = chat(kv_mesh, short_prompt)
    prompt = long_prompt("volcanoes")
    reply = chat(kv_mesh, prompt)
    assert reply.usage is not None and 1300 <= reply.usage.prompt_tokens <= 1800
    # Each seen once: nothing stored but the chat template's head the two prompts share.
    assert kvstore_state(kv_mesh)["chunks"] <= 3
    for again in (short_prompt, prompt):  # the second sight stores them (a local hit)
        chat(kv_mesh, again)
    chunks_after_runs = assert_consistent(kv_mesh)
    chunks_after_kill, killed_text = kill_worker_mid_store(kv_mesh, long_prompt("glaciers", 400))
    return History(
        short_prompt,
        short.choices[0].message.content or "",
        prompt,
        reply.choices[0].message.content or "",
        chunks_after_runs,
        chunks_after_kill,
        killed_text,
    )


def test_second_run_after_a_worker_restart_loads_from_redis(
    kv_mesh: Mesh, history: History
) -> None:
    # The first run's ~94 chunks were all stored, though its prefill outlasted the deadline.
    assert history.chunks_after_runs >= 1280 // 16
    hits = metric(kv_mesh, "meshllm:external_prefix_cache_hits_total")
    loaded = metric(kv_mesh, "meshllm:kv_offload_loaded_bytes_total")
    reply = chat(kv_mesh, history.long_prompt)
    assert reply.choices[0].message.content == history.long_text  # greedy output identical
    assert metric(kv_mesh, "meshllm:external_prefix_cache_hits_total") - hits >= 1280
    assert metric(kv_mesh, "meshllm:kv_offload_loaded_bytes_total") > loaded
    assert metric(kv_mesh, "meshllm:kv_offload_stored_bytes_total") > 0
    assert_consistent(kv_mesh)


def test_a_worker_killed_mid_store_leaves_no_half_chunk(kv_mesh: Mesh, history: History) -> None:
    assert history.chunks_after_kill >= history.chunks_after_runs  # checked consistent then
    assert history.killed_request_text  # completed on the restarted worker
    assert_consistent(kv_mesh)  # and after its recompute stored it again


def tokens_of(mesh: Mesh, prompt: str) -> list[int]:
    """The prompt's token ids as the gateway's chat template and tokenizer make them."""
    _, model = client_of(mesh)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    return list(
        httpx.post(f"{mesh.url('gateway')}/tokenize", json=body, timeout=30).json()["tokens"]
    )


def block_keys(mesh: Mesh, tokens: list[int]) -> list[str]:
    """Suffixes (as `kv_keys` lists them) of the payload keys of the prompt's full blocks."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16)
    _, model = client_of(mesh)
    space = KeySpace(mesh.cluster, model, LAYOUT_VERSION)
    prefix = f"meshllm:{mesh.cluster}:kv:"
    return [space.payload_key(OffloadKey(h, 0))[len(prefix) :] for h in hashes]


def shared_blocks(prompts: list[list[int]]) -> int:
    """Full 16-token blocks every prompt shares from its start."""
    n = 0
    while all(len(p) > n for p in prompts) and len({p[n] for p in prompts}) == 1:
        n += 1
    return n // 16


def test_prompts_seen_once_are_not_stored(kv_mesh: Mesh, history: History) -> None:
    chunks = kvstore_state(kv_mesh)["chunks"]
    skipped = metric(kv_mesh, "meshllm:kv_offload_store_offers_total", decision="skip")
    written = metric(kv_mesh, "meshllm:kv_offload_store_offers_total", decision="write")
    for topic in ("comets", "orchids", "bridges"):
        chat(kv_mesh, long_prompt(topic, words=120), max_tokens=4)
    assert kvstore_state(kv_mesh)["chunks"] == chunks
    assert metric(kv_mesh, "meshllm:kv_offload_store_offers_total", decision="write") == written
    new_skips = metric(kv_mesh, "meshllm:kv_offload_store_offers_total", decision="skip") - skipped
    assert new_skips >= 3 * 12  # ~230 tokens each: every full block was considered, none kept


def test_a_burst_sharing_a_prefix_computes_and_stores_it_once(
    kv_mesh: Mesh, history: History
) -> None:
    notes = long_prompt("lighthouses", words=400)  # ~750 tokens, new to the mesh
    questions = ["Which one is oldest?", "Name two.", "Why red?", "Count them.", "Any ghosts?"]
    prompts = [f"{notes}\n{q}" for q in questions]
    token_ids = [tokens_of(kv_mesh, p) for p in prompts]
    shared = shared_blocks(token_ids)
    assert shared >= 700 // 16
    before = kv_mesh.admin_state("scheduler")["scheduler"]
    with ThreadPoolExecutor(len(prompts)) as pool:  # submitted together
        burst = list(pool.map(lambda p: chat(kv_mesh, p, max_tokens=6), prompts))
    after = kv_mesh.admin_state("scheduler")["scheduler"]
    # Every request but the first found the prefix in the local cache: computed once.
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits >= (len(prompts) - 1) * shared * 16
    # Stored once, from its second sight; no request's own blocks (seen once) are stored.
    assert_consistent(kv_mesh)
    stored, _ = kv_keys(kv_mesh)
    keys = [block_keys(kv_mesh, tokens) for tokens in token_ids]
    assert set(keys[0][:shared]) <= stored
    assert not any(set(own[shared:]) & stored for own in keys)
    # Greedy outputs as each request gives alone.
    for prompt, reply in zip(prompts, burst, strict=True):
        alone = chat(kv_mesh, prompt, max_tokens=6)
        assert alone.choices[0].message.content == reply.choices[0].message.content


def test_kv_keys_deleted_from_redis_fall_back_to_recompute(kv_mesh: Mesh, history: History) -> None:
    r = redis.Redis.from_url(kv_mesh.redis.url)
    for pattern in (f"meshllm:{kv_mesh.cluster}:kv:*", f"meshllm:{kv_mesh.cluster}:kvmeta:*"):
        for key in list(r.scan_iter(pattern, count=1000)):
            r.unlink(key)
    r.close()
    # The short prompt ran before the restart: not in the new worker's cache, and the kvstore
    # still lists its chunks, whose payloads are gone.
    failed = metric(kv_mesh, "meshllm:kv_offload_transfers_total", kind="load", result="failed")
    reply = chat(kv_mesh, history.short_prompt)
    assert reply.choices[0].message.content == history.short_text
    assert (
        metric(kv_mesh, "meshllm:kv_offload_transfers_total", kind="load", result="failed") > failed
    )


def test_kvstore_killed_requests_still_complete_with_a_warning_metric(kv_mesh: Mesh) -> None:
    errors = metric(kv_mesh, "meshllm:kv_offload_errors_total")
    kv_mesh.kill("kvstore")
    prompt = long_prompt("deserts", words=60)  # new: its lookup needs the kvstore
    reply = chat(kv_mesh, prompt, max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert metric(kv_mesh, "meshllm:kv_offload_errors_total") > errors
    again = chat(kv_mesh, prompt, max_tokens=4)  # the local prefix cache gives the same text
    assert again.choices[0].message.content == reply.choices[0].message.content
