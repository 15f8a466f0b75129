"""The launcher's plan: the same services, commands and environment as docker-compose.yml,
with container host names rewritten to loopback. Docker Compose's own resolution (the bundled
binary) is the reference for interpolation. Then its supervision, with real processes."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infra.compose_plan import (
    ComposeError,
    acl_environment,
    environment,
    interpolate,
    load_compose,
    plan,
    rewrite_url,
)
from infra.launcher import Launcher, failing_checks, module_exists, ready_status
from tests.support.redis_server import free_port, free_ports
from tests.unit.infra.compose_cli import COMPOSE_FILE, resolved_config, run_compose

INFRA_SERVICES = {"redis", "redis-acl"}  # the launcher provides these itself


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(COMPOSE_FILE)


@pytest.mark.parametrize("profiles", [(), ("gpu",)])
def test_service_list_and_commands_equal_the_compose_file(
    compose: dict[str, Any], profiles: tuple[str, ...]
) -> None:
    listed = run_compose("config", "--services", profiles=profiles)
    assert listed.returncode == 0, listed.stderr
    expected_names = set(listed.stdout.split()) - INFRA_SERVICES
    resolved = resolved_config(profiles=profiles)["services"]

    services = plan(compose, {}, profiles=frozenset(profiles))
    assert {s.name for s in services} == expected_names
    for s in services:
        assert list(s.command) == resolved[s.name]["command"]
        assert s.module == s.command[2]


@pytest.mark.parametrize(
    "user_env",
    [
        {},
        {
            "MESHLLM_MODEL": "/models/qwen",
            "MESHLLM_LOG_LEVEL": "DEBUG",
            "MESHLLM_REDIS_PASSWORD_WORKER": "pw-w",
            "MESHLLM_MAX_N": "4",
            "MESHLLM_ADMIN_TOKEN": "",
        },
    ],
)
def test_interpolation_matches_docker_compose(
    compose: dict[str, Any], user_env: dict[str, str]
) -> None:
    resolved = resolved_config(user_env, profiles=("gpu", "pd"))["services"]
    for name, spec in compose["services"].items():
        ours = environment(spec, user_env)
        theirs = resolved[name].get("environment", {})
        assert ours == {k: v if v is not None else "" for k, v in theirs.items()}, name


def test_hosts_are_rewritten_to_loopback(compose: dict[str, Any]) -> None:
    services = {
        s.name: s
        for s in plan(compose, {}, redis_port=7777, port_offset=100, profiles=frozenset({"gpu"}))
    }
    gateway = services["gateway"]
    # the user name "gateway" stays; only the host part is a container name
    assert gateway.env["MESHLLM_REDIS_URL"] == (
        "redis://gateway:meshllm-dev-gateway@127.0.0.1:7777/0"
    )
    for s in services.values():  # no service is addressed by a container host name anymore
        urls = [v for v in s.env.values() if "://" in v]
        assert all("@127.0.0.1:" in u or "//127.0.0.1:" in u for u in urls), (s.name, urls)
    assert {name: s.port for name, s in services.items()} == {
        "gateway": 8100,
        "scheduler": 8101,
        "worker": 8102,
        "grammar": 8103,
        "kvstore": 8104,
        "scheduler-gpu": 8111,  # its published host port, so it does not clash with scheduler
        "worker-gpu": 8112,
    }
    for s in services.values():
        assert s.env["MESHLLM_PORT"] == str(s.port)
        assert s.env["MESHLLM_HOST"] == "127.0.0.1"


def test_user_environment_overrides_compose_and_local_defaults(compose: dict[str, Any]) -> None:
    user = {"MESHLLM_MODEL": "/m/tiny", "MESHLLM_HOST": "0.0.0.0", "MESHLLM_CLUSTER": "mine"}
    services = plan(compose, user)
    for s in services:
        assert s.env["MESHLLM_HOST"] == "0.0.0.0"
        assert s.env["MESHLLM_CLUSTER"] == "mine"
        if "MESHLLM_MODEL" in s.env:
            assert s.env["MESHLLM_MODEL"] == "/m/tiny"
            assert not s.env["MESHLLM_MODEL_CACHE_DIR"].startswith("/var/cache")
    assert {s.name for s in services if "MESHLLM_MODEL" in s.env} == {
        "gateway",
        "scheduler",
        "worker",
        "grammar",
    }


def test_every_service_gets_its_name_as_a_stable_instance_id(compose: dict[str, Any]) -> None:
    """One host runs them all, so the hostname default would give every scheduler replica the
    same consumer name; the compose name is unique and the same after a restart."""
    services = plan(compose, {}, profiles=frozenset({"gpu", "pd"}))
    assert all(s.env["MESHLLM_INSTANCE_ID"] == s.name for s in services)
    assert len({s.env["MESHLLM_INSTANCE_ID"] for s in services}) == len(services)


def test_argv_uses_this_interpreter(compose: dict[str, Any]) -> None:
    (scheduler,) = [s for s in plan(compose, {}) if s.name == "scheduler"]
    assert scheduler.argv(sys.executable) == [sys.executable, "-m", "services.scheduler"]


def test_module_exists() -> None:
    assert module_exists("services.scheduler")
    assert not module_exists("services.nothing_here")


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A:-d}", {}, "d"),
        ("${A:-d}", {"A": ""}, "d"),
        ("${A-d}", {"A": ""}, ""),
        ("${A-d}", {}, "d"),
        ("${A:-d}", {"A": "x"}, "x"),
        ("${A:+alt}", {"A": "x"}, "alt"),
        ("${A:+alt}", {"A": ""}, ""),
        ("${A+alt}", {"A": ""}, "alt"),
        ("$A/$B", {"A": "1", "B": "2"}, "1/2"),
        ("${A}", {}, ""),
        ("cost $$5", {}, "cost $5"),
        ("redis://u:${P:-pw}@redis:6379/0", {}, "redis://u:pw@redis:6379/0"),
    ],
)
def test_interpolate(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


def test_interpolate_required_variable() -> None:
    with pytest.raises(ComposeError, match="A is missing: set it"):
        interpolate("${A:?set it}", {"A": ""})
    assert interpolate("${A?set it}", {"A": ""}) == ""


def test_rewrite_url_leaves_other_values_alone() -> None:
    hosts = {("redis", 6379): ("127.0.0.1", 7000)}
    assert rewrite_url("redis://redis:6379/0", hosts) == "redis://127.0.0.1:7000/0"
    assert rewrite_url("redis://redis:6380/0", hosts) == "redis://redis:6380/0"
    assert rewrite_url("redis", hosts) == "redis"
    assert rewrite_url("services.kvstore.lru.LRUPolicy", hosts) == "services.kvstore.lru.LRUPolicy"


def test_failing_checks_of_a_ready_body() -> None:
    workers = "no ready worker group for model 'm' (0 schedulers alive)"
    checks = {"service": "ok", "redis": "ok", "model": "loading", "workers": workers}
    body = json.dumps({"ready": False, "service": "gateway", "checks": checks}).encode()
    assert failing_checks(body) == f"model: loading; workers: {workers}"
    assert failing_checks(b"<html>proxy error</html>") == "<html>proxy error</html>"


# --- supervision: real processes under the launcher ---------------------------------------------


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # polls a condition; no timing is asserted
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_killed_service_and_a_killed_redis_are_restarted_and_serve_again(
    compose: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """compose's `restart: unless-stopped` under `make up`: kill -9 the kvstore, then Redis;
    each comes back, the kvstore is ready again (it reconnects to the new Redis), and the
    launcher keeps running until it is asked to stop."""
    redis_port, offset = free_port(), free_ports(5) - 8000
    env = {"MESHLLM_CLUSTER": "supervise", "MESHLLM_HEARTBEAT_INTERVAL_S": "0.2"}
    (kvstore,) = [
        s
        for s in plan(compose, env, redis_port=redis_port, port_offset=offset)
        if s.name == "kvstore"
    ]
    launcher = Launcher(
        [kvstore],
        redis_port=redis_port,
        acl_env=acl_environment(compose, env),
        log_dir=tmp_path,
    )
    watcher = threading.Thread(target=launcher.watch)
    try:
        launcher.start_redis()
        launcher.start_services()
        launcher.wait_ready(120)
        watcher.start()
        service, redis_process = launcher.children[0], launcher.redis
        assert redis_process is not None

        printed: list[str] = []

        def said(text: str) -> bool:
            printed.append(capsys.readouterr().out)
            return text in "".join(printed)

        for victim in (service, redis_process):
            first = victim.proc
            assert first is not None
            first.send_signal(signal.SIGKILL)
            first.wait()
            wait_for(lambda v=victim: v.restarts == 1 and v.running, f"{victim.name} restart")
            assert victim.proc is not first
            wait_for(lambda: ready_status(kvstore.port)[0], "kvstore ready again", timeout_s=120)
        wait_for(lambda: said("kvstore ready again"), "the launcher saying so")
        assert watcher.is_alive()
        assert launcher.supervisor.restarts == {"redis": 1, "kvstore": 1}
    finally:
        launcher.stop_requested = True
        if watcher.is_alive():
            watcher.join(10)
        launcher.stop()
    out = "".join(printed) + capsys.readouterr().out
    assert "kvstore exited with status -9; restarting in 0.1 s (restart 1)" in out
    assert "redis exited with status -9; restarting in 0.1 s (restart 1)" in out
    assert "kvstore ready again" in out
    assert "restarts: redis 1, kvstore 1" in out
    assert "launcher: kvstore restarted" in (tmp_path / "kvstore.log").read_text()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", redis_port)) != 0  # stopped, not restarted
