"""The compose stack under test: `docker compose` on the production file plus the host-network
override, driven from the host; containers inspected through the `docker` SDK.

The images are built beforehand (`make docker-test`); `up` never builds or pulls, so a missing
image is an error, not a silent multi-minute build inside a test.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import docker
from docker.models.containers import Container

REPO = Path(__file__).resolve().parents[2]
PROJECT = os.environ.get("MESHLLM_DOCKER_PROJECT", "meshllm-test")
ENV_FILE = REPO / "infra" / "docker" / "test.env"
COMPOSE_FILES = (REPO / "docker-compose.yml", REPO / "docker-compose.test.yml")
MESH_SERVICES = ("gateway", "scheduler", "worker", "grammar", "kvstore")
LONG_RUNNING = ("redis", *MESH_SERVICES)
UP_TIMEOUT_S = 900  # a cold start converts SmolLM2 into the model-cache volume


def env_file_values() -> dict[str, str]:
    values = {}
    for line in ENV_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def compose(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `docker compose` for the test project; raise with its output when it fails."""
    cmd = ["docker", "compose", "-p", PROJECT, "--env-file", str(ENV_FILE)]
    for file in COMPOSE_FILES:
        cmd += ["-f", str(file)]
    # A developer's MESHLLM_* settings must not leak into the stack under test.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHLLM_", "COMPOSE_"))}
    result = subprocess.run(
        [*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"docker compose {' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result


@dataclass
class Stack:
    client: docker.DockerClient
    gateway_port: int
    redis_port: int

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    def container(self, service: str) -> Container:
        found = self.client.containers.list(
            ignore_removed=True,
            all=True,
            filters={
                "label": [
                    f"com.docker.compose.project={PROJECT}",
                    f"com.docker.compose.service={service}",
                ]
            },
        )
        assert len(found) == 1, f"{service}: {len(found)} containers"
        return found[0]

    def health(self, service: str) -> str:
        container = self.container(service)
        container.reload()
        state = container.attrs["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def wait_healthy(self, services: tuple[str, ...] = LONG_RUNNING, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = {s: self.health(s) for s in services}
            if all(v == "healthy" for v in status.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout} s: {status}\n{self.logs()}")
            time.sleep(1)

    def exec(self, service: str, cmd: list[str]) -> tuple[int, str]:
        code, output = self.container(service).exec_run(cmd, demux=False)
        return int(code), output.decode(errors="replace")

    def logs(self, tail: int = 30) -> str:
        parts = []
        for service in ("redis-acl", *LONG_RUNNING):
            try:
                text = self.container(service).logs(tail=tail).decode(errors="replace")
            except (AssertionError, docker.errors.DockerException) as exc:
                text = f"<{exc}>"
            parts.append(f"--- {service}\n{text}")
        return "\n".join(parts)


def start_stack() -> Stack:
    """`docker compose up -d --wait`; on failure the error carries every service's last logs."""
    values = env_file_values()
    up = ("up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S), "--no-build")
    try:
        compose(*up, "--pull", "never", timeout=UP_TIMEOUT_S + 60)
    except RuntimeError as exc:
        logs = compose("logs", "--tail", "40", "--no-color", timeout=60).stdout
        raise RuntimeError(f"{exc}\n--- logs\n{logs[-12000:]}") from None
    return Stack(
        client=docker.from_env(timeout=120),
        gateway_port=int(values.get("MESHLLM_TEST_GATEWAY_PORT", 18000)),
        redis_port=int(values.get("MESHLLM_TEST_REDIS_PORT", 16379)),
    )


def stop_stack() -> None:
    compose("down", "-v", "--timeout", "20", timeout=300)
