"""Two worker groups behind one gateway: KV-aware routing keeps each prefix on the group that
caches it (cached_tokens tells), round robin does not; a restarted gateway routes by cache again
from the groups' KV events; a burst past the queue bound gets 429 + Retry-After and nothing 5xx;
a group whose worker or scheduler is killed mid-stream hands its requests to the other group and
every stream completes with the tokens of the run without the fault."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPICS = ("harbour logistics", "alpine botany", "medieval bookbinding")
PREFIXES = [
    " ".join(f"Section {i} of the {topic} manual describes step {i} in detail." for i in range(24))
    for topic in TOPICS
]
ENV = {
    **E2E_ENV,
    "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
    "MESHLLM_CLAIM_IDLE_MS": "2000",
    "MESHLLM_MAX_NUM_SEQS": "8",
}


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(env=ENV, groups=2) as m:
        yield m


def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=180)


def complete(mesh: Mesh, prompt: str, **kw: object) -> openai.types.Completion:
    c = client(mesh)
    model = c.models.list().data[0].id
    return c.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, **kw)


def cached(reply: openai.types.Completion) -> tuple[int, int]:
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0, usage.prompt_tokens


def rounds(mesh: Mesh, first: int, count: int) -> list[list[tuple[int, int]]]:
    """`count` rounds over the prefixes, one request at a time; (cached, prompt) per request."""
    return [
        [cached(complete(mesh, f"{p}\nQuestion {r}: which step comes first?")) for p in PREFIXES]
        for r in range(first, first + count)
    ]


def restart_gateway(mesh: Mesh, **env: str) -> None:
    mesh.kill("gateway")
    mesh.restart("gateway", env)


def decisions(mesh: Mesh, group: str) -> float:
    return mesh.metric("gateway", "meshllm:router_decisions_total", group=group)


def test_kv_routing_returns_each_prefix_to_its_group(mesh: Mesh) -> None:
    got = rounds(mesh, 0, 3)
    for hits in got[1:]:
        for cached_tokens, prompt_tokens in hits:
            assert cached_tokens >= prompt_tokens - 32, got  # the prefix, all but a block or two
    assert decisions(mesh, "0") > 0 and decisions(mesh, "1") > 0  # both groups took traffic
    for name in ("scheduler", "scheduler-g1"):
        assert mesh.admin_state(name)["steps_run"] > 0


def test_a_restarted_gateway_routes_by_cache_again(mesh: Mesh) -> None:
    restart_gateway(mesh)
    state = mesh.admin_state("gateway")["router"]
    assert set(state["groups"]) == {"0", "1"} and state["kv_events_applied"] > 0
    for cached_tokens, prompt_tokens in rounds(mesh, 10, 1)[0]:
        assert cached_tokens >= prompt_tokens - 32


def test_round_robin_does_not_keep_affinity(mesh: Mesh) -> None:
    restart_gateway(mesh, MESHLLM_ROUTER_POLICY="round_robin")
    # 3 prefixes over 2 groups in turn: a prefix changes group from one round to the next, and
    # the group it lands on has not seen this round's question: only a cold prefix is left.
    got = rounds(mesh, 20, 2)
    misses = [c for r in got for c, p in r if c < p - 32]
    assert len(misses) >= 2, got


def test_a_burst_past_the_queue_bound_is_shed_with_429(mesh: Mesh) -> None:
    restart_gateway(mesh, MESHLLM_MAX_QUEUED_PER_GROUP="1")
    c = client(mesh)
    model = c.models.list().data[0].id

    def one(i: int) -> int | str:
        body = {"model": model, "prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0}
        resp = httpx.post(f"{mesh.api}/completions", json=body, timeout=180)
        if resp.status_code == 429:
            assert int(resp.headers["Retry-After"]) >= 1
            return 429
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert 429 in got, got
    assert all(g in (429, "stop", "length") for g in got), got  # nothing 5xx, accepted finish
    assert mesh.metric("gateway", "meshllm:requests_shed_total") >= got.count(429)


def stream_all(mesh: Mesh, started: threading.Event | None = None) -> list[list[int]]:
    """8 streamed requests, greedy and seeded, by token ids (logprobs carry the tokens)."""
    c = client(mesh)
    model = c.models.list().data[0].id
    arrived = [0]
    lock = threading.Lock()

    def one(i: int) -> list[int]:
        sampling = {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": 1000 + i}
        stream = c.completions.create(
            model=model,
            prompt=f"{PREFIXES[i % 3]}\nStory {i}:",
            max_tokens=48,
            stream=True,
            logprobs=0,
            extra_body={"ignore_eos": True},
            **sampling,  # type: ignore[arg-type]
        )
        tokens: list[str] = []
        for chunk in stream:
            choice = chunk.choices[0]
            if choice.logprobs and choice.logprobs.tokens:
                tokens.extend(choice.logprobs.tokens)
                with lock:
                    arrived[0] += 1
                    if started is not None and arrived[0] >= 16:
                        started.set()
        return tokens  # type: ignore[return-value]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(8)))


@pytest.mark.parametrize("victim", ["worker-g1", "scheduler-g1"])
def test_a_group_killed_mid_stream_hands_its_requests_over(mesh: Mesh, victim: str) -> None:
    restart_gateway(mesh, MESHLLM_ROUTER_POLICY="round_robin")  # both groups hold requests
    baseline = stream_all(mesh)
    assert all(len(t) == 48 for t in baseline)
    started = threading.Event()
    killer = threading.Thread(
        target=lambda: started.wait(300) and mesh.kill(victim, signal.SIGKILL), daemon=True
    )
    killer.start()
    faulty = stream_all(mesh, started)
    killer.join()
    assert started.is_set()
    assert faulty == baseline  # nothing lost, nothing repeated, the same tokens
    mesh.restart(victim)
    mesh.wait_ready("scheduler-g1")
