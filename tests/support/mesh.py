"""A real meshllm mesh for end-to-end tests: a private redis-server and the services as
separate processes (`python -m services.<name>`), each on its own free port.

Tests talk to it with real clients (openai, httpx), and can kill -9 / restart any service to
check that no accepted request is lost. With `acl=True` Redis loads the rendered ACL file
(infra/redis/render_acl.py) and each service connects as its own user, as under `make up`;
`admin()` is then the operator's client for inspection.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis as redis_py

from infra.redis.render_acl import redis_url, render_acl
from tests.support.redis_server import RedisServer, free_port
from tests.support.scratch import scratch_dir

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "scheduler", "worker", "grammar", "kvstore")


class Mesh:
    def __init__(
        self,
        services: tuple[str, ...] = ("gateway", "scheduler", "worker"),
        env: dict[str, str] | None = None,
        redis: RedisServer | None = None,
        acl: bool = False,
        groups: int = 1,
        ready_timeout: float = 120.0,
    ) -> None:
        """`groups` > 1: worker groups 1.. besides group 0, each a `scheduler-g<i>` and a
        `worker-g<i>` (with MESHLLM_GROUP=i), started after the named services.
        `ready_timeout`: how long `start` waits for each service to answer ready."""
        self.ready_timeout = ready_timeout
        extra = [(f"{m}-g{i}", m, i) for i in range(1, groups) for m in ("scheduler", "worker")]
        self.services = (*services, *(name for name, _, _ in extra))
        self.modules = {name: module for name, module, _ in extra}
        self.group_env = {name: {"MESHLLM_GROUP": str(i)} for name, _, i in extra}
        self.logdir = scratch_dir(self, "meshllm-e2e-")
        self.acl_env = {"MESHLLM_REDIS_PASSWORD_ADMIN": "e2e-admin"} if acl else None
        if redis is None and self.acl_env is not None:
            acl_file = self.logdir / "users.acl"
            acl_file.write_text(render_acl(self.acl_env))
            redis = RedisServer(extra_args=["--aclfile", str(acl_file)])
            self.owns_redis = True
        else:
            self.owns_redis = redis is None
        self.redis = redis or RedisServer()
        self.ports = {name: free_port() for name in (*SERVICES, *self.modules)}
        self.cluster = f"t{os.getpid()}"
        self.extra_env = dict(env or {})
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._starts: dict[str, int] = {}

    # --- addresses -------------------------------------------------------------------------
    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    @property
    def api(self) -> str:
        return f"{self.url('gateway')}/v1"

    def redis_url(self, name: str) -> str:
        if self.acl_env is None:
            return self.redis.url
        return redis_url(self.modules.get(name, name), "127.0.0.1", self.redis.port, self.acl_env)

    def admin(self) -> redis_py.Redis:
        """A client of all access: the ACL's admin user, or the default one without ACL."""
        if self.acl_env is None:
            return redis_py.Redis.from_url(self.redis.url)
        password = self.acl_env["MESHLLM_REDIS_PASSWORD_ADMIN"]
        return redis_py.Redis(port=self.redis.port, username="admin", password=password)

    def env_for(self, name: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_")}
        env.update(
            {
                "MESHLLM_REDIS_URL": self.redis_url(name),
                "MESHLLM_CLUSTER": self.cluster,
                "MESHLLM_PORT": str(self.ports[name]),
                "MESHLLM_HOST": "127.0.0.1",
                "MESHLLM_INSTANCE_ID": f"{name}-0",
                "MESHLLM_LOG_JSON": "true",
                "MESHLLM_MODEL_CACHE_DIR": os.environ.get(
                    "MESHLLM_MODEL_CACHE_DIR", str(Path("~/.cache/meshllm").expanduser())
                ),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        env.update(overrides or {})
        return env

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> Mesh:
        if self.owns_redis:
            self.redis.start()
        for name in self.services:
            self.start_service(name)
        # The gateway is ready only once a scheduler with a ready worker serves its model:
        # waited for last, so each wait covers one service's own start.
        for name in sorted(self.services, key=lambda n: n == "gateway"):
            self.wait_ready(name, self.ready_timeout)
        return self

    def start_service(self, name: str, overrides: dict[str, str] | None = None) -> None:
        self.spawn(
            name,
            self.modules.get(name, name),
            {**self.group_env.get(name, {}), **(overrides or {})},
        )

    def spawn(self, name: str, module: str, overrides: dict[str, str] | None = None) -> None:
        """Start `python -m services.<module>` as service `name`: its port, env and a log file
        per start (`<name>.<n>.log`, read by `tail`)."""
        n = self._starts.get(name, 0)
        self._starts[name] = n + 1
        log = open(self.logdir / f"{name}.{n}.log", "wb")  # noqa: SIM115 - owned by the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", f"services.{module}"],
            cwd=REPO,
            env=self.env_for(name, overrides),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, name: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")
            try:
                if httpx.get(f"{self.url(name)}/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{name} not ready after {timeout} s:\n{self.tail(name)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(30)

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` (SIGSTOP / SIGCONT: freeze and thaw) without waiting for an exit."""
        self.procs[name].send_signal(sig)

    def restart(self, name: str, overrides: dict[str, str] | None = None) -> None:
        self.start_service(name, overrides)
        self.wait_ready(name)
        self.wait_serving()

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Until the gateway (when this mesh runs one) is ready again: after a scheduler or
        worker restart it refuses new requests (503) until the group's ready beat reaches it."""
        gateway = self.procs.get("gateway")
        if gateway is not None and gateway.poll() is None:
            self.wait_ready("gateway", timeout)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.owns_redis:
            self.redis.stop()

    # --- inspection ------------------------------------------------------------------------
    def tail(self, name: str, lines: int = 40) -> str:
        n = self._starts.get(name, 1) - 1
        path = self.logdir / f"{name}.{n}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def admin_state(self, name: str) -> dict:
        token = self.extra_env.get("MESHLLM_ADMIN_TOKEN", "")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        resp = httpx.get(f"{self.url(name)}/admin/state", headers=headers, timeout=5.0)
        resp.raise_for_status()
        return resp.json()

    def metric(self, name: str, metric: str, **labels: str) -> float:
        """Sum of service `name`'s Prometheus samples of `metric` whose labels include
        `labels` (all its samples when none are given)."""
        text = httpx.get(f"{self.url(name)}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
            if not m or m.group(1) != metric:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
        return total

    def __enter__(self) -> Mesh:
        try:
            return self.start()
        except BaseException:
            self.stop()  # a failed start leaves no service running (no __exit__ follows)
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
