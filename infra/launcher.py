"""`make up`: the mesh of docker-compose.yml as local processes.

Reads the compose file (infra/compose_plan.py), starts a private redis-server with the rendered
ACL, starts every mesh service with this interpreter, waits until each answers 200 on /ready
(all at once, under one deadline: the gateway is ready only after a scheduler with a ready
worker is, so its wait spans theirs), prints where the API is only then, and on Ctrl-C /
SIGTERM stops everything: SIGTERM to each service
(gateway first, so no new request enters while the rest drain), wait, SIGKILL what is left,
then Redis. Children run in their own sessions so a terminal's Ctrl-C reaches only the
launcher, which then stops them in that order.

Until then every process is supervised like compose's `restart: unless-stopped`
(infra/supervisor.py): one that dies, Redis included, is restarted with backoff, and the
restart is printed and counted. The rest of the mesh keeps serving meanwhile (a restarted
scheduler or worker picks up the requests in flight; a restarted Redis comes back empty and
the services recreate their consumer groups).

    python -m infra.launcher [--compose docker-compose.yml] [--profile gpu] [--services a,b]
                             [--redis-port 6379] [--port-offset 0] [--log-dir DIR]
                             [--replicas N]

`--replicas N` (`make up REPLICAS=N`) runs N worker groups: groups 1.. are copies of the
default scheduler + worker (`scheduler-<i>`, `worker-<i>`, MESHLLM_GROUP=i) on ports offset by
100 per group (8101, 8102, ...), each printed when ready; the gateway routes among them.

Exit status: 0 after a requested stop, 1 when the mesh could not be started (redis-server
missing, a service module missing, not ready within --ready-timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from infra.compose_plan import LocalService, acl_environment, load_compose, plan, replicate
from infra.redis.render_acl import render_acl
from infra.supervisor import Supervised, Supervisor

ROOT = Path(__file__).resolve().parent.parent
REDIS_CONF = ROOT / "infra" / "redis" / "redis.conf"
STOP_TIMEOUT_S = 45.0  # the services' drain bound (30 s) plus closing


class LaunchError(RuntimeError):
    pass


def say(message: str) -> None:
    print(message, flush=True)


def module_exists(module: str) -> bool:
    """`services.gateway` -> services/gateway/__main__.py exists under the repository root."""
    return (ROOT / Path(*module.split(".")) / "__main__.py").is_file()


def wait_redis(port: int, proc: subprocess.Popen[bytes] | None, timeout_s: float = 15.0) -> None:
    """Until redis answers (NOAUTH counts: the default user is disabled, the server is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is None or proc.poll() is not None:
            raise LaunchError(f"redis-server exited with status {proc and proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise LaunchError(f"redis-server did not answer on port {port} within {timeout_s:.0f} s")


def ready_status(port: int) -> tuple[bool, str]:
    """(answered 200 on /ready, why not): the checks that are not "ok", from the 503 body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return bool(response.status == 200), ""
    except urllib.error.HTTPError as exc:
        return False, failing_checks(exc.read(4096))
    except (urllib.error.URLError, OSError) as exc:
        return False, f"not answering ({exc})"


def failing_checks(body: bytes) -> str:
    """`name: state` of each check of a /ready body that is not "ok"."""
    try:
        checks = json.loads(body).get("checks", {})
        return "; ".join(f"{k}: {v}" for k, v in checks.items() if v != "ok")
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


class Launcher:
    def __init__(
        self,
        services: list[LocalService],
        *,
        redis_port: int,
        acl_env: dict[str, str],
        log_dir: Path | None = None,
        python: str = sys.executable,
    ) -> None:
        self.services = services
        self.redis_port = redis_port
        self.acl_env = acl_env
        self.log_dir = log_dir
        self.python = python
        self.workdir = Path(tempfile.mkdtemp(prefix="meshllm-up-"))
        self.supervisor = Supervisor(say)
        self.redis: Supervised | None = None
        self.children: list[Supervised] = []
        self.stop_requested = False

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None, port: int | None = None
    ) -> Supervised:
        log = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None  # noqa: SIM115
        process = Supervised(name, argv, ROOT, env=env, port=port, log=log)
        self.supervisor.start(process)
        return process

    def start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise LaunchError("redis-server is not installed: run `make redis`")
        acl = self.workdir / "users.acl"
        acl.write_text(render_acl(self.acl_env))
        argv = [binary, str(REDIS_CONF), "--bind", "127.0.0.1", "--port", str(self.redis_port),
                "--aclfile", str(acl), "--dir", str(self.workdir)]  # fmt: skip
        self.redis = self._spawn("redis", argv, None)
        wait_redis(self.redis_port, self.redis.proc)
        print(f"redis-server on 127.0.0.1:{self.redis_port}", flush=True)

    def start_services(self) -> None:
        for service in self.services:
            if not module_exists(service.module):
                raise LaunchError(f"{service.name}: module {service.module} does not exist")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **service.env}
            child = self._spawn(service.name, service.argv(self.python), env, service.port)
            self.children.append(child)

    def wait_ready(self, timeout_s: float) -> None:
        """Until every service answers 200 on /ready (one that dies meanwhile is restarted); a
        LaunchError naming each one that does not (with its failing checks) past `timeout_s`."""
        pending = {c.name: c for c in self.children}
        why: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            if self.stop_requested:
                raise LaunchError("stopped before the mesh was ready")
            self.supervisor.poll()
            for name, child in list(pending.items()):
                if not child.running or child.port is None:
                    why[name] = "not running (restarting)" if child.port else "no HTTP port"
                    continue
                ready, why[name] = ready_status(child.port)
                if ready:
                    print(f"{name} ready on http://127.0.0.1:{child.port}", flush=True)
                    del pending[name]
            if time.monotonic() > deadline:
                waiting = ", ".join(f"{name} ({why[name]})" for name in pending)
                raise LaunchError(f"not ready after {timeout_s:.0f} s: {waiting}")
            time.sleep(0.2)

    def watch(self) -> None:
        """Until a stop is requested: restart what dies, say when a restarted service is
        ready again."""
        recovering: dict[str, Supervised] = {}
        while not self.stop_requested:
            for process in self.supervisor.poll():
                if process.port is not None:
                    recovering[process.name] = process
            for name, process in list(recovering.items()):
                if process.running and process.port is not None and ready_status(process.port)[0]:
                    say(f"{name} ready again on http://127.0.0.1:{process.port}")
                    del recovering[name]
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM in start order (gateway first), wait, then SIGKILL stragglers; Redis last."""
        running = [c for c in self.children if c.running]
        for child in running:
            assert child.proc is not None
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in running:
            assert child.proc is not None
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{child.name} did not stop in time; killing it", flush=True)
                child.proc.kill()
                child.proc.wait()
        if self.redis is not None and self.redis.running:
            assert self.redis.proc is not None
            self.redis.proc.terminate()
            try:
                self.redis.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.redis.proc.kill()
                self.redis.proc.wait()
        restarts = {name: n for name, n in self.supervisor.restarts.items() if n}
        if restarts:
            say("restarts: " + ", ".join(f"{name} {n}" for name, n in restarts.items()))
        for process in self.supervisor.processes:
            if process.log is not None:
                process.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True


def api_banner(services: list[LocalService]) -> str:
    gateway = next((s for s in services if s.module == "services.gateway"), None)
    if gateway is None:
        return "meshllm is up (no gateway in this launch)"
    return f"meshllm is up: OpenAI API at http://127.0.0.1:{gateway.port}/v1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the meshllm mesh as local processes.")
    parser.add_argument("--compose", type=Path, default=ROOT / "docker-compose.yml")
    parser.add_argument("--profile", action="append", default=[], help="compose profile")
    parser.add_argument("--services", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--redis-port", type=int, default=6379)
    parser.add_argument("--port-offset", type=int, default=0, help="added to every HTTP port")
    parser.add_argument(
        "--replicas", type=int, default=1, help="worker groups (scheduler + worker) to run"
    )
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", type=Path, help="one log file per service (default: here)")
    args = parser.parse_args(argv)

    compose = load_compose(args.compose)
    services = plan(
        compose,
        os.environ,
        redis_port=args.redis_port,
        port_offset=args.port_offset,
        profiles=frozenset(args.profile),
    )
    services = replicate(services, args.replicas)
    if args.services:
        wanted = [s.strip() for s in args.services.split(",") if s.strip()]
        unknown = set(wanted) - {s.name for s in services}
        if unknown:
            parser.error(f"unknown services: {', '.join(sorted(unknown))}")
        services = [s for s in services if s.name in wanted]
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)

    launcher = Launcher(
        services,
        redis_port=args.redis_port,
        acl_env=acl_environment(compose, os.environ),
        log_dir=args.log_dir,
    )
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    status = 0
    try:
        launcher.start_redis()
        launcher.start_services()
        launcher.wait_ready(args.ready_timeout)
        print(api_banner(services), flush=True)
        launcher.watch()
    except LaunchError as exc:
        if not launcher.stop_requested:
            print(f"launcher: {exc}", file=sys.stderr, flush=True)
            status = 1
    finally:
        print("stopping meshllm ...", flush=True)
        launcher.stop()
        print("stopped", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
