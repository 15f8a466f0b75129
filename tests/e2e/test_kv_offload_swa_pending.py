"""A second request arrives while the first one's KV writes to the tier are still in flight,
on a sliding-window model (a tiny random-weight Gemma-3-style model: layers sliding / full /
sliding, window 16, block 16), served by two worker groups sharing one kvstore on a real Redis.

The first request (A) goes to one group whose worker is frozen (SIGSTOP) right before: its
scheduler plans A's prefill and offers A's chunks for store, so the kvstore holds them
"writing", but no worker writes them yet. The second request (B, same prompt) goes to the other
group (round-robin routing): its lookup sees HIT_PENDING and it is deferred step after step,
neither recomputing nor reading a half-written chunk. The worker is thawed: A computes, its
writes land, and B loads A's prefix: every full-attention chunk and, for the sliding group,
only its window chunk (the store mask wrote nothing else). Both outputs equal transformers'
greedy output on the same weights, i.e. a cold run.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM

from tests.e2e.swa_gemma3 import BLOCK, make_swa_model, swa_env
from tests.support.mesh import Mesh
from tests.support.tiny_llama import random_prompt, reference_greedy

PROMPT_LEN = 5 * BLOCK + 7  # the hit cap (len - 1) is 86 tokens -> 5 chunks
MAX_TOKENS = 6
GROUPS = {"0": ("scheduler", "worker"), "1": ("scheduler-g1", "worker-g1")}


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_swa_model(smollm2_dir, tmp_path_factory, "tiny-gemma3-swa-pending")


@pytest.fixture(scope="module")
def mesh(model_dir: Path) -> Iterator[Mesh]:
    env = swa_env(
        model_dir,
        # a frozen worker is declared dead after 5 beats: 10 s, far longer than this test needs
        MESHLLM_HEARTBEAT_INTERVAL_S="2.0",
        MESHLLM_KV_STORE_POLICY="always",  # A's chunks are written at their first sight
        MESHLLM_KV_PENDING_WRITE_WAIT_S="60",
        MESHLLM_ROUTER_POLICY="round_robin",
    )
    services = ("gateway", "scheduler", "worker", "kvstore")
    with Mesh(services=services, env=env, groups=2) as m:
        yield m


def wait_until(check, timeout: float = 60.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def complete(mesh: Mesh, prompt: list[int], max_tokens: int = MAX_TOKENS) -> str:
    client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    resp = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"min_tokens": max_tokens},
    )
    return resp.choices[0].text


def writing(mesh: Mesh) -> int:
    """Chunks the kvstore holds reserved for a write that has not landed."""
    return int(mesh.admin_state("kvstore")["kvstore"].get("writing", 0))


def offload_stats(mesh: Mesh, group: str) -> dict:
    return dict(mesh.admin_state(GROUPS[group][0])["kv_offload"]["stats"])


def stored_keys_by_group(mesh: Mesh) -> dict[str, int]:
    """Payload keys (model:version:group:hash) in Redis, counted per KV group."""
    r = redis.Redis.from_url(mesh.redis.url, decode_responses=True)
    prefix = f"meshllm:{mesh.cluster}:kv:"
    counts: dict[str, int] = {}
    for key in r.scan_iter(prefix + "*", count=1000):
        group = key.rsplit(":", 2)[-2]
        counts[group] = counts.get(group, 0) + 1
    r.close()
    return counts


def warm_up(mesh: Mesh, seed: int) -> str | None:
    """Send a one-token request; the group the gateway's router chose (None: not routed)."""
    before = {g: mesh.metric("gateway", "meshllm:router_decisions_total", group=g) for g in GROUPS}
    complete(mesh, random_prompt(PROMPT_LEN, seed), max_tokens=1)
    after = {g: mesh.metric("gateway", "meshllm:router_decisions_total", group=g) for g in GROUPS}
    chosen = [g for g in GROUPS if after[g] > before[g]]
    return chosen[0] if len(chosen) == 1 else None


def test_a_request_waits_for_the_window_being_written_and_matches_a_cold_run(
    mesh: Mesh, model_dir: Path
) -> None:
    # Which group takes the next request: round robin alternates once both groups report
    # their load (before that a request may go to the shared stream, or the router may see one
    # group only). Warm-up requests until two in a row were routed to different groups.
    routed = [warm_up(mesh, 99)]
    for seed in range(100, 110):
        routed.append(warm_up(mesh, seed))
        if None not in routed[-2:] and routed[-1] != routed[-2]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"round robin never alternated: {routed}")
    group_b = routed[-1]
    group_a = next(g for g in GROUPS if g != group_b)
    wait_until(lambda: writing(mesh) == 0, timeout=30, what="the warm-ups' writes landed")
    keys_before = stored_keys_by_group(mesh)

    prompt = random_prompt(PROMPT_LEN, 8)
    outputs: dict[str, str] = {}
    mesh.signal(GROUPS[group_a][1], signal.SIGSTOP)  # A's worker: A's writes cannot land
    try:
        thread_a = threading.Thread(target=lambda: outputs.update(a=complete(mesh, prompt)))
        thread_a.start()
        wait_until(
            lambda: writing(mesh) > 0,
            timeout=8,
            what="A's chunks reserved in the kvstore (writing)",
        )
        thread_b = threading.Thread(target=lambda: outputs.update(b=complete(mesh, prompt)))
        thread_b.start()
        wait_until(
            lambda: offload_stats(mesh, group_b)["pending_defers"] >= 2,
            timeout=8,
            what="B deferred on HIT_PENDING",
        )
        stats_b = offload_stats(mesh, group_b)
        assert stats_b["loads_started"] == 0  # neither loaded half written...
        assert "b" not in outputs  # ...nor computed: still waiting
    finally:
        mesh.signal(GROUPS[group_a][1], signal.SIGCONT)
    thread_a.join(120)
    thread_b.join(120)
    assert set(outputs) == {"a", "b"}
    stats_b = offload_stats(mesh, group_b)
    assert stats_b["external_hit_tokens"] == 5 * BLOCK  # A's prefix, loaded once it landed
    assert stats_b["loads_started"] == 1 and stats_b["loads_failed"] == 0
    # Stored for A: the full group's five chunks and the sliding group's window chunk only.
    keys = stored_keys_by_group(mesh)
    added = sorted(keys.get(g, 0) - keys_before.get(g, 0) for g in keys)
    assert added == [1, 5]
    reference = Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = reference_greedy(reference, prompt, MAX_TOKENS, min_tokens=MAX_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert outputs["a"] == outputs["b"] == tokenizer.decode(expected)
