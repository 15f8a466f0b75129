"""`make up` supervises like compose's `restart: unless-stopped`: under `python -m
infra.launcher`, kill -9 the worker while requests stream; the launcher restarts it, the
requests in flight complete (the scheduler re-runs them on the new worker), the mesh serves new
requests, and the launcher is still running. Then the same for its Redis: the mesh serves again.
SIGTERM still stops everything with status 0.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import MODEL_CACHE
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import REPO
from tests.support.redis_server import free_port, free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SERVICES = ("gateway", "scheduler", "worker")
MAX_TOKENS = 40


class Launched:
    """A launcher process and everything it printed."""

    def __init__(self, tmp_path: Path) -> None:
        self.offset, self.redis_port = free_ports(5) - 8000, free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLLM_")}
        env.update(
            {
                **E2E_ENV,
                "MESHLLM_CLUSTER": "supervised",
                "MESHLLM_MODEL_CACHE_DIR": str(MODEL_CACHE),
                # a dead worker is noticed in ~2 s, its pending work claimed after 3 s
                "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
                "MESHLLM_CLAIM_IDLE_MS": "3000",
            }
        )
        argv = [sys.executable, "-m", "infra.launcher", "--services", ",".join(SERVICES),
                "--redis-port", str(self.redis_port), "--port-offset", str(self.offset),
                "--log-dir", str(tmp_path), "--ready-timeout", "400"]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert self.proc.stdout is not None
        self.reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stream: object) -> None:
        for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
            self.lines.put(line)

    def wait_for(self, text: str, timeout_s: float = 400) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.seen):
            assert self.proc.poll() is None, "".join(self.seen)
            assert time.monotonic() < deadline, f"no {text!r} in:\n" + "".join(self.seen)
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=1))

    def output(self) -> str:
        """Everything printed, once the launcher has exited."""
        self.reader.join(30)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{8000 + self.offset}/v1"

    def child_pid(self, command: str) -> int:
        """The pid of the launcher's child whose command line contains `command`."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        for pid in map(int, children.split()):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if command in cmdline:
                return pid
        raise AssertionError(f"no child running {command!r}")


@pytest.fixture
def launched(tmp_path: Path, smollm2_dir: Path) -> Iterator[Launched]:
    launcher = Launched(tmp_path)
    try:
        launcher.wait_for("meshllm is up")
        yield launcher
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.send_signal(signal.SIGTERM)
            launcher.proc.wait(120)


def stream_chat(client: openai.OpenAI, model: str, progress: list[int], i: int) -> int:
    """One streamed chat; returns its completion tokens (usage chunk)."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Tell me story number {i}."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            progress[i] += 1
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def until(condition: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # polls a condition; no timing is asserted
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_killed_worker_and_a_killed_redis_are_restarted_and_the_mesh_serves_on(
    launched: Launched,
) -> None:
    client = openai.OpenAI(base_url=launched.api, api_key="x", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    progress = [0, 0]
    results: list[int | BaseException] = [0, 0]

    def run(i: int) -> None:
        try:
            results[i] = stream_chat(client, model, progress, i)
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    until(lambda: min(progress) >= 3, f"no progress: {progress}")
    assert max(progress) < MAX_TOKENS - 5, "requests finished before the kill: test too slow"
    os.kill(launched.child_pid("services.worker"), signal.SIGKILL)
    launched.wait_for("worker exited with status -9; restarting")
    launched.wait_for("worker ready again")
    for t in threads:
        t.join(600)
    assert results == [MAX_TOKENS, MAX_TOKENS], results  # completed, every token delivered

    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert answer.choices[0].finish_reason in ("stop", "length")

    os.kill(launched.child_pid("redis-server"), signal.SIGKILL)
    launched.wait_for("redis restarted")
    until(lambda: serves(client, model), "the mesh serving after Redis came back")
    assert launched.proc.poll() is None

    launched.proc.send_signal(signal.SIGTERM)
    assert launched.proc.wait(120) == 0
    out = launched.output()
    assert "restarts: redis 1, worker 1" in out and out.rstrip().endswith("stopped"), out


def serves(client: openai.OpenAI, model: str) -> bool:
    try:
        resp = client.with_options(timeout=30).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    except openai.APIError:
        return False
    return resp.choices[0].finish_reason in ("stop", "length")
