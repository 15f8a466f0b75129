"""MESHLLM_API_PROCESSES=2: two gateway processes on the one API port (vLLM's
--api-server-count). Both take connections and serve; /metrics from either is both processes'
counts; a drain reaching one drains both; SIGTERM to the gateway ends both and exits 0; an API
process that dies takes the gateway down (exit 1) for its supervisor to restart."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

TOKEN = "api-processes-admin"
ENV = {**E2E_ENV, "MESHLLM_API_PROCESSES": "2", "MESHLLM_ADMIN_TOKEN": TOKEN}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(env=ENV) as m:
        yield m


def state_of_each(mesh: Mesh, timeout: float = 60.0) -> dict[int, dict]:
    """The /admin/state of each API process, by its index: asked on new connections until
    both have answered (the kernel gives each connection to whichever accepts first)."""
    seen: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only API processes {sorted(seen)} answered"
        with httpx.Client(headers=AUTH, timeout=10) as fresh:  # one connection each
            state = fresh.get(f"{mesh.url('gateway')}/admin/state").json()
        seen[state["api_process"]["index"]] = state
    return seen


def completions(mesh: Mesh, count: int) -> list[str]:
    def one(i: int) -> str:
        client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
        try:
            reply = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=f"Count from {i}:",
                max_tokens=4,
                temperature=0,
            )
        finally:
            client.close()
        return reply.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def test_both_processes_serve_and_metrics_sum_them(mesh: Mesh) -> None:
    states = state_of_each(mesh)  # the mesh waited for /ready: both have started
    assert {s["api_process"]["count"] for s in states.values()} == {2}
    assert all(s["started"] for s in states.values())
    with httpx.Client(timeout=10) as fresh:
        assert fresh.get(f"{mesh.url('gateway')}/ready").json()["checks"]["api_processes"] == "ok"
    assert {s["instance_id"] for s in states.values()} == {"gateway-0-api0", "gateway-0-api1"}
    streams = {s["gateway"]["reply_stream"] for s in states.values()}
    assert len(streams) == 2  # each its own replies
    texts = completions(mesh, 24)
    assert len(texts) == 24 and all(texts)
    # Every request counted once, whichever process served it and whichever answers /metrics.
    for _ in range(4):
        with httpx.Client(timeout=10) as fresh:
            metrics = fresh.get(f"{mesh.url('gateway')}/metrics").text
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("meshllm:request_success_total{")
        )
        assert total == 24
        assert 'meshllm:service_ready{service="gateway"} 1.0' in metrics


def test_a_drain_reaching_one_drains_both_then_sigterm_ends_them_with_0(mesh: Mesh) -> None:
    pids = [s["api_process"]["pid"] for s in state_of_each(mesh).values()]
    resp = httpx.post(f"{mesh.url('gateway')}/admin/actions/drain", headers=AUTH, timeout=60)
    assert resp.status_code == 200
    deadline = time.monotonic() + 30
    while not all(s["stopping"] for s in state_of_each(mesh).values()):
        assert time.monotonic() < deadline, "the other API process did not drain"
        time.sleep(0.2)
    for _ in range(6):
        with httpx.Client(timeout=10) as fresh:
            assert fresh.get(f"{mesh.url('gateway')}/ready").status_code == 503
    gateway = mesh.procs["gateway"]
    gateway.send_signal(signal.SIGTERM)
    assert gateway.wait(60) == 0, mesh.tail("gateway", 60)
    for pid in pids:
        assert not alive(pid), pid


def test_a_dead_api_process_takes_the_gateway_down(mesh: Mesh) -> None:
    states = state_of_each(mesh)
    os.kill(states[1]["api_process"]["pid"], signal.SIGKILL)
    gateway = mesh.procs["gateway"]
    assert gateway.wait(60) == 1
    assert not alive(states[0]["api_process"]["pid"])
    assert "exited with code -9; stopping the others" in mesh.tail("gateway", 200)


def alive(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True
