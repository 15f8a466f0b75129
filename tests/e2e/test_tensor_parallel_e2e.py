"""A mesh whose worker group runs two tensor-parallel ranks (MESHLLM_TP=2, CPU, gloo) on
SmolLM2 (its 3 KV heads split 1 + 2): the OpenAI API answers with transformers' greedy tokens,
and killing rank 1 mid-decode takes the group down at once (no hang in a collective); the group
restarts and every accepted request completes with the tokens of an undisturbed run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from tests.e2e.conftest import E2E_ENV
from tests.support.concurrent_chats import stream_chats
from tests.support.mesh import Mesh
from tests.support.tiny_llama import reference_greedy

MAX_TOKENS = 24
STREAMED = [
    ("Tell me a story about a dragon.", {"temperature": 0.0}),
    ("Write a poem about autumn.", {"temperature": 0.8, "seed": 1234}),
]


@pytest.fixture(scope="module")
def tp_mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    env = {
        **E2E_ENV,
        "MESHLLM_TP": "2",
        "MESHLLM_TP_TIMEOUT_S": "20",
        "MESHLLM_KV_OFFLOAD": "false",
        "MESHLLM_DTYPE": "float32",
        "MESHLLM_MAX_MODEL_LEN": "1024",
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_CLAIM_IDLE_MS": "3000",
    }
    with Mesh(env=env) as m:
        yield m


def _client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=300)


def test_tp2_greedy_completions_equal_transformers(tp_mesh: Mesh, smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = tp_mesh.admin_state("worker")
    assert state["tp"] == 2 and len(state["rank_pids"]) == 1
    client = _client(tp_mesh)
    model = client.models.list().data[0].id
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for text in ["The capital of France is", "def add(a, b):\n   "]:
        prompt = tokenizer(text)["input_ids"]
        resp = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"min_tokens": 16}
        )
        expected = reference_greedy(reference, prompt, 16, min_tokens=16)
        assert resp.choices[0].text == tokenizer.decode(expected)


def _stream_all(mesh: Mesh, progress: list[int]) -> list[str]:
    return stream_chats(_client(mesh), STREAMED, MAX_TOKENS, progress)


def test_killed_rank_takes_the_group_down_and_loses_no_request(tp_mesh: Mesh) -> None:
    undisturbed = _stream_all(tp_mesh, [0] * len(STREAMED))
    before = tp_mesh.admin_state("worker")
    follower = before["rank_pids"]["1"]
    progress = [0] * len(STREAMED)
    result: list[list[str]] = []
    streams = threading.Thread(target=lambda: result.append(_stream_all(tp_mesh, progress)))
    streams.start()
    deadline = time.monotonic() + 120
    while min(progress) < 3:  # every request is mid-decode
        assert time.monotonic() < deadline, f"no progress: {progress}"
        time.sleep(0.02)
    assert max(progress) < MAX_TOKENS - 5, "requests finished before the kill: test too slow"
    os.kill(follower, signal.SIGKILL)
    worker = tp_mesh.procs["worker"]
    # Rank 0 notices (the broken collective or the exited process) and exits by itself.
    try:
        code = worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        tp_mesh.signal("worker", signal.SIGUSR1)  # its threads' stacks into its log
        time.sleep(2)
        tail = tp_mesh.tail("worker", 120)
        pytest.fail(f"rank 0 still runs 60 s after rank 1 was killed:\n{tail}")
    assert code != 0, tp_mesh.tail("worker")
    tp_mesh.restart("worker")  # what the supervisor does (compose restart, infra/launcher.py)
    streams.join(300)
    assert result, "requests did not complete"
    assert result[0] == undisturbed
    after = tp_mesh.admin_state("worker")
    assert after["incarnation"] != before["incarnation"]
    assert after["rank_pids"]["1"] != follower
