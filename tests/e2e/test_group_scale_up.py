"""A worker group added while the mesh serves (a scale-up): until its worker has loaded, its
scheduler takes no request from the shared stream, so every request runs on the groups that can
run it now; once the worker announces itself, the new group takes its share."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = "scheduler-g2"  # the new group's scheduler
NEW_WORKER = "worker-g2"
NEW_GROUP = {"MESHLLM_GROUP": "2"}


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    env = {**E2E_ENV, "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5"}
    with Mesh(env=env) as m:
        yield m


def state(mesh: Mesh, name: str) -> dict:
    return httpx.get(f"{mesh.url(name)}/admin/state", timeout=10).json()


def wait_until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def ask(client: openai.OpenAI, model: str, n: int) -> str | None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Say the number {n}."}],
        max_tokens=6,
        temperature=0,
    )
    return reply.choices[0].finish_reason


def test_new_group_waits_for_its_worker_then_serves(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    mesh.ports[NEW] = free_port()
    mesh.spawn(NEW, "scheduler", {**NEW_GROUP, "MESHLLM_INSTANCE_ID": f"{NEW}-0"})
    # Its intake runs from the end of start(); two beats later it has surely begun.
    wait_until(lambda: answers(f"{mesh.url(NEW)}/health"), 60, "no /health from it")
    wait_until(lambda: state(mesh, NEW)["heartbeats_sent"] >= 2, 60, "no heartbeat")
    assert httpx.get(f"{mesh.url(NEW)}/ready", timeout=5).status_code == 503  # no worker

    with ThreadPoolExecutor(4) as pool:
        finished = list(pool.map(lambda n: ask(client, model, n), range(8)))
    assert all(f in ("stop", "length") for f in finished), finished
    assert state(mesh, NEW)["inflight_entries"] == 0  # it took none of them

    mesh.ports[NEW_WORKER] = free_port()
    mesh.spawn(NEW_WORKER, "worker", {**NEW_GROUP, "MESHLLM_INSTANCE_ID": f"{NEW_WORKER}-0"})
    mesh.wait_ready(NEW_WORKER)
    mesh.wait_ready(NEW)
    # Both groups now read the stream: keep requests coming until the new one ran some.
    deadline = time.monotonic() + 180
    n = 100
    while state(mesh, NEW)["steps_run"] == 0:
        assert time.monotonic() < deadline, "the new group never ran a step"
        with ThreadPoolExecutor(4) as pool:
            finished = list(pool.map(lambda i: ask(client, model, i), range(n, n + 4)))
        assert all(f in ("stop", "length") for f in finished), finished
        n += 4
