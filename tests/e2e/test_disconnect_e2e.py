"""A client that goes away mid-request frees what the request held in the mesh: the scheduler
drops it from running/waiting, its KV blocks return to the pool, the abort is counted, and the
gateway's in-flight slots are released.

Each test first sees the request running on the scheduler (its blocks taken), then cuts the
connection, then polls the scheduler's /admin/state against a deadline.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

DEADLINE_S = 60.0
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


def scheduler(mesh: Mesh) -> dict[str, Any]:
    return mesh.admin_state("scheduler")


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def idle_state(mesh: Mesh) -> dict[str, Any]:
    """The scheduler's state once nothing is queued or running (the baseline to return to)."""
    state: dict[str, Any] = {}

    def idle() -> bool:
        state.update(scheduler(mesh))
        return not state["running_request_ids"] and not state["waiting_request_ids"]

    wait_until(idle, "the scheduler is idle")
    return state


def assert_freed(mesh: Mesh, request_ids: list[str], before: dict[str, Any]) -> None:
    free_before = before["scheduler"]["num_free_blocks"]

    def freed() -> bool:
        state = scheduler(mesh)
        queued = set(state["running_request_ids"]) | set(state["waiting_request_ids"])
        free = state["scheduler"]["num_free_blocks"]
        return not queued & set(request_ids) and free == free_before

    wait_until(freed, f"{request_ids} are gone and {free_before} blocks are free again")
    after = scheduler(mesh)["scheduler"]
    assert after["num_aborted"] == before["scheduler"]["num_aborted"] + len(request_ids)
    # num_finished counts aborts too: every request that ended since was one of these aborts
    assert after["num_finished"] == before["scheduler"]["num_finished"] + len(request_ids)
    wait_until(lambda: mesh.admin_state("gateway")["gateway"]["in_flight"] == 0, "gateway idle")


def test_stream_closed_mid_way_frees_the_blocks(mesh: Mesh, model_name: str) -> None:
    before = idle_state(mesh)
    body = {"model": model_name, "prompt": "Once upon a time", "stream": True, **LONG}
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{mesh.api}/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        # Keep the iterator referenced: an abandoned httpx line iterator is closed when it is
        # collected, and closing it closes the connection (too early for this test).
        lines = resp.iter_lines()
        chunks = []
        while len(chunks) < 3:
            line = next(lines)
            if line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
        request_id = f"{chunks[0]['id']}-0"
        state = scheduler(mesh)
        held = state["running_request_ids"] + state["waiting_request_ids"]
        assert request_id in held, json.dumps(state)
        assert state["scheduler"]["num_free_blocks"] < before["scheduler"]["num_free_blocks"]
        # leaving the block closes the connection with the stream unfinished
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert_freed(mesh, [request_id], before)


def test_non_streaming_client_gone_frees_every_choice(mesh: Mesh, model_name: str) -> None:
    """A non-streaming chat with n=2 over a raw socket, closed while both choices run."""
    before = idle_state(mesh)
    body = json.dumps(
        {
            "model": model_name,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "n": 2,
            **LONG,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", mesh.ports["gateway"]))
    try:
        sock.sendall(head + body)
        running: list[str] = []

        def both_running() -> bool:
            running[:] = scheduler(mesh)["running_request_ids"]
            return len(running) == 2

        wait_until(both_running, "both choices run")
    finally:
        sock.close()
    assert sorted(r.rsplit("-", 1)[1] for r in running) == ["0", "1"]
    assert_freed(mesh, running, before)


def test_the_mesh_serves_after_the_disconnects(mesh: Mesh, model_name: str) -> None:
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
    resp = httpx.post(f"{mesh.api}/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "length"
