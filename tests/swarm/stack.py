"""The Swarm stack under test: secrets, the rendered stack file, `docker stack deploy`, and the
task containers of a one-node swarm (inspected and exec'd through the `docker` SDK).

The images are built and the swarm initialised beforehand (`make swarm-test`,
infra/swarm/swarm_test.sh); deploying never builds or pulls (`--resolve-image never`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import httpx
from docker.models.containers import Container

REPO = Path(__file__).resolve().parents[2]
STACK = os.environ.get("MESHLLM_SWARM_STACK", "meshllm-swarm-test")
ENV_FILE = REPO / "infra" / "docker" / "test.env"
TEST_OVERLAY = REPO / "infra" / "swarm" / "test.yml"
GATEWAY_PORT = int(os.environ.get("MESHLLM_TEST_SWARM_GATEWAY_PORT", "18100"))
ADMIN_TOKEN = "swarm-test-admin-token"
API_KEY = "sk-swarm-test"
SERVICES = ("redis", "gateway", "scheduler", "worker", "grammar", "kvstore")
UP_TIMEOUT_S = 1800  # a cold start converts SmolLM2 into the model-cache volume; busy CI

# Read inside a task container: its service's /metrics, with the port its MESHLLM_PORT names.
METRICS_PROBE = (
    "import os, urllib.request; "
    "print(urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"MESHLLM_PORT\"]}/metrics', "
    "timeout=5).read().decode())"
)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without a developer's MESHLLM_* / COMPOSE_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHLLM_", "COMPOSE_"))}
    env.update(extra)
    return env


def run(cmd: list[str], *, timeout: float = 300, **kwargs: object) -> str:
    result = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kwargs
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result.stdout


def service(name: str) -> str:
    return f"{STACK}_{name}"


def metric_total(text: str, name: str) -> float:
    """Sum of a metric's samples over its labels in a Prometheus text exposition."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


@dataclass
class SwarmStack:
    client: docker.DockerClient

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{GATEWAY_PORT}"

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def scale(self, groups: int, detach: bool) -> None:
        """Scheduler and worker to `groups` replicas in one command (slot k = group k)."""
        args = ["docker", "service", "scale"]
        if detach:
            args.append("--detach")
        run([*args, f"{service('scheduler')}={groups}", f"{service('worker')}={groups}"])

    def tasks(self, name: str) -> dict[int, str]:
        """Running tasks of a service: slot -> task id."""
        out = {}
        for task in self.client.services.get(service(name)).tasks({"desired-state": "running"}):
            if task["Status"]["State"] == "running":
                out[int(task["Slot"])] = str(task["ID"])
        return out

    def container(self, name: str, slot: int) -> Container:
        found = self.client.containers.list(
            ignore_removed=True,
            filters={
                "label": f"com.docker.swarm.service.name={service(name)}",
                "status": "running",
            },
        )
        mine = [
            c
            for c in found
            if c.labels.get("com.docker.swarm.task.name", "").startswith(f"{service(name)}.{slot}.")
        ]
        if len(mine) != 1:
            raise LookupError(f"{service(name)} slot {slot}: {len(mine)} running containers")
        return mine[0]

    def metrics(self, name: str, slot: int) -> str:
        code, out = self.container(name, slot).exec_run(["python", "-c", METRICS_PROBE])
        if code != 0:
            raise RuntimeError(f"{name}.{slot} /metrics: {out.decode(errors='replace')}")
        return out.decode()

    def gateway_groups(self) -> dict[str, bool]:
        """Worker group -> ready, as the gateway's mesh view (its /admin/state) has them."""
        state = httpx.get(
            f"{self.url}/admin/state",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        ).json()
        return {s["group"]: bool(s["ready"]) for s in state["mesh"]["schedulers"]}  # alive ones

    def wait_healthy(self, timeout: float = UP_TIMEOUT_S) -> None:
        """Every service has all its replicas running with a healthy container, and the
        gateway answers /ready 200 through the published port."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.health()
            if all(status.values()) and self.gateway_ready():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout} s: {status}\n{self.logs()}")
            time.sleep(2)

    def health(self) -> dict[str, bool]:
        out = {}
        for name in SERVICES:
            svc = self.client.services.get(service(name))
            wanted = svc.attrs["Spec"]["Mode"]["Replicated"]["Replicas"]
            containers = self.client.containers.list(
                ignore_removed=True,
                filters={"label": f"com.docker.swarm.service.name={service(name)}"},
            )
            healthy = [
                c
                for c in containers
                if c.attrs["State"].get("Health", {}).get("Status") == "healthy"
            ]
            out[name] = len(healthy) == wanted
        return out

    def gateway_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def logs(self, tail: int = 30) -> str:
        parts = []
        for name in SERVICES:
            try:
                text = run(["docker", "service", "logs", "--tail", str(tail), service(name)])
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                text = f"<{exc}>"
            parts.append(f"--- {name}\n{text}")
        return "\n".join(parts)


def create_secrets() -> None:
    env = clean_env(MESHLLM_ADMIN_TOKEN=ADMIN_TOKEN, MESHLLM_API_KEYS=API_KEY)
    run([sys.executable, "-m", "infra.swarm.secrets", "create"], env=env)


def remove_secrets() -> None:
    run([sys.executable, "-m", "infra.swarm.secrets", "remove"], env=clean_env())


def deploy() -> SwarmStack:
    """Render the stack (compose file + stack.yml + test.yml, test.env) and deploy it."""
    stack_file = run(
        [
            sys.executable,
            "-m",
            "infra.swarm.stack_file",
            "--env-file",
            str(ENV_FILE),
            "-f",
            str(TEST_OVERLAY),
        ],
        env=clean_env(),
    )
    run(
        ["docker", "stack", "deploy", "--resolve-image", "never", "-c", "-", STACK],
        input=stack_file,
        env=clean_env(),
    )
    stack = SwarmStack(client=docker.from_env(timeout=120))
    stack.wait_healthy()
    return stack


def remove_stack() -> None:
    """`docker stack rm`, then wait until its containers are gone and remove its volumes."""
    subprocess.run(["docker", "stack", "rm", STACK], capture_output=True, timeout=120)
    client = docker.from_env(timeout=120)
    label = f"com.docker.stack.namespace={STACK}"
    deadline = time.monotonic() + 120
    while client.containers.list(all=True, filters={"label": label}, ignore_removed=True):
        if time.monotonic() > deadline:
            raise AssertionError(f"containers of {STACK} still there after docker stack rm")
        time.sleep(1)
    for volume in client.volumes.list():
        if volume.name.startswith(f"{STACK}_"):
            volume.remove(force=True)
