"""A private, real redis-server on a free loopback port, for tests."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.scratch import scratch_dir


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()


def free_ports(count: int = 1) -> int:
    """The first of `count` consecutive loopback ports that are free now, none handed out
    before by this process, all below the ephemeral range.

    A port from `bind(0)` lies inside the ephemeral range, so between the test picking it and
    the service binding it any outgoing connection (a Redis client, httpx) may take it as its
    local port: CI saw a scheduler fail with "Address already in use" that way. Ports below the
    range are only ever taken by listeners, and the set keeps this process from handing one out
    twice.
    """
    low = min(ephemeral_range()[0], 65536) - count
    for _ in range(1000):
        first = random.randrange(10000, max(10001, low))
        ports = range(first, first + count)
        if _handed_out.intersection(ports) or not all(map(_bindable, ports)):
            continue
        _handed_out.update(ports)
        return first
    raise RuntimeError(f"no {count} free consecutive loopback ports below {low + count}")


def free_port() -> int:
    return free_ports(1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisServer:
    """Start/stop/restart a redis-server bound to 127.0.0.1 with persistence off."""

    def __init__(self, port: int | None = None, extra_args: list[str] | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it with apt)")
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.workdir = scratch_dir(self, "meshllm-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def redis_url_or_private(url: str = "") -> Iterator[str]:
    """`url` when given, else a private RedisServer's, stopped when the block exits (benches'
    `--redis-url` default)."""
    if url:
        yield url
        return
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.stop()
