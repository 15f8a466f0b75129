"""Each service as a real process: ready, metrics, admin auth, heartbeats, SIGTERM -> 0.
Then the local launcher (`python -m infra.launcher`) bringing the mesh up and down.

The gateway is tested by its owner; the launcher test starts it only once
services/gateway/__main__.py exists.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from infra.launcher import module_exists
from shared.codec import decode
from shared.config import (
    GatewaySettings,
    GrammarSettings,
    KVStoreSettings,
    SchedulerSettings,
    WorkerSettings,
)
from shared.protocol import Heartbeat
from shared.streams import Streams
from tests.conftest import MODEL_CACHE
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import REPO, Mesh
from tests.support.redis_server import free_port, free_ports

pytestmark = pytest.mark.e2e

SHELLS = ("grammar", "kvstore", "scheduler", "worker")
TOKEN = "e2e-admin-token"
DEFAULT_PORTS = {
    name: cls.model_fields["port"].default
    for name, cls in [
        ("gateway", GatewaySettings),
        ("scheduler", SchedulerSettings),
        ("worker", WorkerSettings),
        ("grammar", GrammarSettings),
        ("kvstore", KVStoreSettings),
    ]
}
# The e2e suite's small KV cache (conftest.E2E_ENV): at its default (30% of free memory) the
# worker spends ~25 s of its start allocating and touching a cache these tests never fill.
FAST_BEATS = {
    "MESHLLM_HEARTBEAT_INTERVAL_S": "0.2",
    "MESHLLM_LOG_LEVEL": "INFO",
    "MESHLLM_KV_CACHE_BYTES": E2E_ENV["MESHLLM_KV_CACHE_BYTES"],
    "MESHLLM_MAX_MODEL_LEN": E2E_ENV["MESHLLM_MAX_MODEL_LEN"],
}


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with Mesh(services=SHELLS, env={**FAST_BEATS, "MESHLLM_ADMIN_TOKEN": TOKEN}) as m:
        yield m


def heartbeats(mesh: Mesh, service: str) -> list[Heartbeat]:
    client = redis.Redis.from_url(mesh.redis.url)
    entries = client.xrange(Streams(mesh.cluster).heartbeats)
    client.close()
    beats = [decode(fields[b"m"], Heartbeat) for _, fields in entries]
    return [b for b in beats if b.service == service]


def healthcheck(port: int) -> int:
    env = {**os.environ, "MESHLLM_PORT": str(port)}
    return subprocess.run(
        [sys.executable, "-m", "infra.healthcheck"], cwd=REPO, env=env, capture_output=True
    ).returncode


@pytest.mark.parametrize("name", SHELLS)
def test_ready_health_metrics(mesh: Mesh, name: str) -> None:
    base = mesh.url(name)
    ready = httpx.get(f"{base}/ready").json()
    assert ready["ready"] is True and ready["service"] == name
    # the base checks; a service that outgrew its shell (the worker's model) adds its own
    assert ready["checks"]["service"] == "ok" and ready["checks"]["redis"] == "ok"
    assert set(ready["checks"].values()) == {"ok"}
    assert httpx.get(f"{base}/health").status_code == 200
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert f'meshllm:service_ready{{service="{name}"}} 1.0' in metrics.text
    assert f'meshllm:heartbeats_sent_total{{service="{name}"}}' in metrics.text
    assert healthcheck(mesh.ports[name]) == 0


@pytest.mark.parametrize("name", SHELLS)
def test_admin_auth(mesh: Mesh, name: str) -> None:
    base = mesh.url(name)
    assert httpx.get(f"{base}/admin/state").status_code == 401
    wrong = {"Authorization": "Bearer not-the-token"}
    assert httpx.get(f"{base}/admin/state", headers=wrong).status_code == 403
    assert httpx.post(f"{base}/admin/actions/drain", headers=wrong).status_code == 403
    state = mesh.admin_state(name)
    assert state["service"] == name and state["started"] is True
    assert state["config"]["admin_token"] == "***"
    assert state["event_loop"] == "uvloop.Loop"  # CommonSettings.event_loop's default


@pytest.mark.parametrize("name", SHELLS)
def test_heartbeats_carry_the_incarnation(mesh: Mesh, name: str) -> None:
    incarnation = mesh.admin_state(name)["incarnation"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        beats = [b for b in heartbeats(mesh, name) if b.ready]
        if len(beats) >= 2:
            break
        time.sleep(0.1)
    assert len(beats) >= 2
    assert {b.incarnation for b in beats} == {incarnation}
    assert {b.instance_id for b in beats} == {f"{name}-0"}


@pytest.mark.parametrize("name", SHELLS)
def test_sigusr1_dumps_every_threads_stack_and_the_service_goes_on(mesh: Mesh, name: str) -> None:
    mesh.signal(name, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    # faulthandler's dump: the main thread with its Python frames, down to run_service.
    while "run_service" not in (log := mesh.tail(name, 400)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "Current thread" in log and 'File "' in log and "run_service" in log, log[-2000:]
    assert mesh.procs[name].poll() is None
    assert httpx.get(f"{mesh.url(name)}/ready").json()["ready"] is True


@pytest.mark.parametrize("name", SHELLS)
def test_sigterm_exits_0(mesh: Mesh, name: str) -> None:
    mesh.procs[name].send_signal(signal.SIGTERM)
    assert mesh.procs[name].wait(10) == 0, mesh.tail(name)
    assert "shutting down" in mesh.tail(name)


def test_sigterm_with_redis_gone_exits_0_before_the_drain_timeout() -> None:
    """A stack torn down at once (`docker stack rm`) stops Redis with the services. Every
    service still exits 0 promptly: none sits out the drain timeout in a bus call that waits
    for Redis (the worker's plan read, the RPC servers' group reads took the whole 30 s)."""
    names = ("gateway", *SHELLS)
    env = {**FAST_BEATS, "MESHLLM_SHUTDOWN_TIMEOUT_S": "30"}
    with Mesh(services=names, env=env) as m:
        m.redis.stop()
        for name in names:
            m.procs[name].send_signal(signal.SIGTERM)
        for name in names:
            assert m.procs[name].wait(10) == 0, m.tail(name)
            assert "did not stop within" not in m.tail(name, 200), m.tail(name)


def test_drain_action_then_sigterm() -> None:
    with Mesh(services=("kvstore",), env={**FAST_BEATS, "MESHLLM_ADMIN_TOKEN": TOKEN}) as m:
        base = m.url("kvstore")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        resp = httpx.post(f"{base}/admin/actions/drain", headers=auth)
        assert resp.json() == {"action": "drain", "result": {"drained": True, "stopping": True}}
        ready = httpx.get(f"{base}/ready")
        assert ready.status_code == 503 and ready.json()["checks"]["service"] == "draining"
        assert healthcheck(m.ports["kvstore"]) == 1
        assert httpx.get(f"{base}/health").status_code == 200  # alive, just not taking work
        m.procs["kvstore"].send_signal(signal.SIGTERM)
        assert m.procs["kvstore"].wait(10) == 0


def test_without_admin_token_actions_are_disabled() -> None:
    env = {**FAST_BEATS, "MESHLLM_ADMIN_TOKEN": "", "MESHLLM_EVENT_LOOP": "asyncio"}
    with Mesh(services=("grammar",), env=env) as m:
        base = m.url("grammar")
        state = httpx.get(f"{base}/admin/state")
        assert state.status_code == 200
        assert state.json()["event_loop"].startswith("asyncio.")  # the standard library's
        resp = httpx.post(f"{base}/admin/actions/drain")
        assert resp.status_code == 403
        assert "MESHLLM_ADMIN_TOKEN" in resp.json()["error"]["message"]
        assert httpx.get(f"{base}/ready").status_code == 200


# --- the local launcher -----------------------------------------------------------------------


def free_port_block(count: int = 5, base: int = 8000) -> int:
    """An offset such that base+offset .. base+offset+count-1 are all free."""
    return free_ports(count) - base


def read_lines(stream: object, into: queue.Queue[str]) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        into.put(line)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_launcher_brings_the_mesh_up_and_down(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    present = [n for n in ("gateway", *SHELLS) if module_exists(f"services.{n}")]
    if "gateway" in present:
        request.getfixturevalue("smollm2_dir")  # the gateway loads the tokenizer at start
    offset, redis_port = free_port_block(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_")}
    env.update(
        {
            "MESHLLM_CLUSTER": "launch",
            "MESHLLM_MODEL_CACHE_DIR": str(MODEL_CACHE),
            "MESHLLM_REDIS_PASSWORD_ADMIN": "launch-admin",
            "MESHLLM_REDIS_PASSWORD_WORKER": "launch-worker-pw",
            **FAST_BEATS,
        }
    )
    argv = [sys.executable, "-m", "infra.launcher", "--services", ",".join(present),
            "--redis-port", str(redis_port), "--port-offset", str(offset),
            "--log-dir", str(tmp_path), "--ready-timeout", "240"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("meshllm is up" in line for line in seen):
            assert proc.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        # "up" only after every service, the gateway included, answered 200 on /ready
        announced = [line.split()[0] for line in seen if " ready on http://" in line]
        assert sorted(announced) == sorted(present), "".join(seen)
        for name in present:
            port = DEFAULT_PORTS[name] + offset
            assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200, name
        if "gateway" in present:
            assert f"http://127.0.0.1:{8000 + offset}/v1" in "".join(seen)

        # every service authenticated as its own ACL user and heartbeats on the stream
        admin = redis.Redis(port=redis_port, username="admin", password="launch-admin")
        beats = [decode(f[b"m"], Heartbeat) for _, f in admin.xrange("meshllm:launch:heartbeats")]
        assert {b.service for b in beats} == set(present)
        users = {c["user"] for c in admin.client_list()}
        assert set(present) <= users
        admin.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(90)
    assert status == 0, "".join(seen)
    assert not port_open(redis_port)
    for name in present:
        assert not port_open(DEFAULT_PORTS[name] + offset), name


def test_launcher_never_says_up_while_the_gateway_has_no_worker_group(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    """Only the gateway: it loads and answers, but no scheduler beats, so it never becomes
    ready; the launcher gives up at its deadline naming the gateway's failing check."""
    offset, redis_port = free_port_block(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_")}
    env.update({"MESHLLM_CLUSTER": "alone", "MESHLLM_MODEL_CACHE_DIR": str(MODEL_CACHE)})
    argv = [sys.executable, "-m", "infra.launcher", "--services", "gateway",
            "--redis-port", str(redis_port), "--port-offset", str(offset),
            "--log-dir", str(tmp_path), "--ready-timeout", "20"]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "meshllm is up" not in done.stdout
    assert "gateway ready" not in done.stdout
    assert "not ready after 20 s: gateway (" in done.stderr
    assert "workers: no ready worker group for model 'SmolLM2-135M-Instruct'" in done.stderr
    assert not port_open(8000 + offset) and not port_open(redis_port)
