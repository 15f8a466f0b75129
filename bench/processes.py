"""Servers the benchmarks start and stop: the mesh through infra/launcher.py (the same
processes `make up` runs), vLLM's OpenAI server, and the CPU seconds each one burns (/proc).

Every server runs in its own process group, so `stop` ends it with all of its children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until `url` answers 200; fails early if the server exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (the launcher drains its services), then KILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_mesh(
    log_dir: Path,
    env: dict[str, str],
    *,
    services: str = "gateway,scheduler,worker",
    port_offset: int = 300,
    redis_port: int = 16398,
    repo: Path = REPO,
) -> tuple[subprocess.Popen[bytes], str]:
    """The mesh's `services` (and a private redis-server) as local processes, run from the
    checkout `repo` with `env` over this environment; the gateway on 8000 + port_offset.
    Returns the launcher's process and the API's base URL."""
    cmd = [sys.executable, "-m", "infra.launcher", "--services", services]
    cmd += ["--port-offset", str(port_offset), "--redis-port", str(redis_port)]
    cmd += ["--log-dir", str(log_dir)]
    proc = subprocess.Popen(
        cmd, cwd=repo, env={**os.environ, **env}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{8000 + port_offset}"
    wait_http(f"{base}/ready", proc, 900)
    return proc, f"{base}/v1"


def start_vllm(
    python: str, model_dir: str, log_dir: Path, threads: int, port: int = 18123
) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's OpenAI server from another venv (`python`), bf16 on `threads` CPU cores."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
    }
    log = open(log_dir / "vllm.log", "wb")  # noqa: SIM115 - owned by the process
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += ["--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=log)
    wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900)
    return proc, f"http://127.0.0.1:{port}/v1"


def _stat_fields(pid: int) -> list[str]:
    # The command name (field 2) may hold spaces: split after its closing parenthesis.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry))[1]), []).append(int(entry))
            except OSError:
                continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one live process (0 once it is gone)."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (a gateway's API and planning
    processes): each live one's own and that of its children it has reaped (0 for any gone)."""
    ticks = 0
    for member in (pid, *descendants(pid)):
        try:
            ticks += sum(int(f) for f in _stat_fields(member)[11:15])  # u/s time, reaped kids'
        except OSError:
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def service_pids(launcher_pid: int, names: tuple[str, ...]) -> dict[str, int]:
    """The pid of each named service (`services.<name>`, or `redis-server`) under a launcher."""
    pids = {}
    for pid in descendants(launcher_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        for name in names:
            if (f"services.{name}" in cmd or name in cmd.split(" ")[0]) and "launcher" not in cmd:
                pids[name] = pid
    return pids
