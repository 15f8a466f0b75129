"""No accepted request is lost: kill -9 the worker or the scheduler mid-decode, start a new one,
and every request completes with exactly the tokens of an undisturbed run.

Greedy requests must match trivially once recomputed; the seeded, sampled ones match because the
sampler's noise is keyed by (seed, position, token id) only, so a recomputation draws the same
tokens. A restarted scheduler re-reads its own pending requests and continues each from its
progress checkpoint (services/scheduler/resume.py); the gateway drops the token indexes it
already streamed (those generated after the checkpoint, regenerated identically).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest

from shared.streams import Streams
from tests.e2e.conftest import E2E_ENV
from tests.support.concurrent_chats import stream_chats
from tests.support.mesh import Mesh

MAX_TOKENS = 40
REQUESTS = [
    ("Tell me a story about a dragon.", {"temperature": 0.0}),
    ("Describe the ocean.", {"temperature": 0.0}),
    ("Write a poem about autumn.", {"temperature": 0.8, "seed": 1234}),
    ("Explain how a bicycle works.", {"temperature": 0.8, "seed": 99}),
]


@pytest.fixture(scope="module")
def crash_mesh(smollm2_dir) -> Iterator[Mesh]:
    # A short heartbeat so a dead worker is noticed in ~5 s instead of waiting for a step timeout.
    env = {
        **E2E_ENV,
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_CLAIM_IDLE_MS": "3000",
        "MESHLLM_PROGRESS_CHECKPOINT_S": "0.2",
    }
    with Mesh(env=env) as m:
        yield m


def _client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=300)


def _stream_all(mesh: Mesh, progress: list[int]) -> list[str]:
    """Run the four requests concurrently (streaming); progress[i] counts chunks received."""
    return stream_chats(_client(mesh), REQUESTS, MAX_TOKENS, progress)


def _checkpointed(mesh: Mesh) -> int:
    """Requests with a progress checkpoint (on the shared and the group's requests stream)."""
    s = Streams(mesh.cluster)
    db = mesh.admin()
    return sum(db.hlen(s.progress(stream)) for stream in (s.requests, s.group_requests("0")))


def _disturbed(mesh: Mesh, victim: str) -> list[str]:
    progress = [0] * len(REQUESTS)
    result: list[list[str]] = []
    runner = threading.Thread(target=lambda: result.append(_stream_all(mesh, progress)))
    runner.start()
    deadline = time.monotonic() + 120
    while min(progress) < 3:  # every request is mid-decode
        assert time.monotonic() < deadline, f"no progress: {progress}"
        time.sleep(0.02)
    while victim == "scheduler" and _checkpointed(mesh) < len(REQUESTS):
        assert time.monotonic() < deadline, "no progress checkpoints"
        time.sleep(0.02)
    assert max(progress) < MAX_TOKENS - 5, "requests finished before the kill: test too slow"
    mesh.kill(victim)
    mesh.restart(victim)
    runner.join(300)
    assert result, "requests did not complete"
    return result[0]


@pytest.fixture(scope="module")
def undisturbed(crash_mesh: Mesh) -> list[str]:
    return _stream_all(crash_mesh, [0] * len(REQUESTS))


def test_worker_killed_mid_decode_loses_nothing(crash_mesh: Mesh, undisturbed: list[str]):
    before = crash_mesh.admin_state("worker")["incarnation"]
    got = _disturbed(crash_mesh, "worker")
    assert crash_mesh.admin_state("worker")["incarnation"] != before
    assert got == undisturbed


def test_scheduler_killed_mid_decode_loses_nothing(crash_mesh: Mesh, undisturbed: list[str]):
    got = _disturbed(crash_mesh, "scheduler")
    assert got == undisturbed
    state = crash_mesh.admin_state("scheduler")
    assert state["inflight_entries"] == 0  # every request acked once finished
    # The restarted scheduler continued all four from their checkpoints, not from the prompt.
    progress = state["progress"]
    assert (progress["resumed_from_checkpoint"], progress["resumed_from_prompt"]) == (4, 0)
    assert all(n >= 1 for n in progress["recently_resumed"].values())
    deadline = time.monotonic() + 10  # fields go in the round after their request finished
    while _checkpointed(crash_mesh):
        assert time.monotonic() < deadline, "checkpoints of finished requests left behind"
        time.sleep(0.05)
