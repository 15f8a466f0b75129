"""The test harness's port picker: ports a service can still bind when it starts."""

from __future__ import annotations

import socket

import pytest

import tests.support.redis_server as ports_module
from tests.support.redis_server import ephemeral_range, free_ports


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    low, _high = ephemeral_range()
    firsts = [free_ports(5) for _ in range(50)]
    ports = [first + i for first in firsts for i in range(5)]
    assert all(1024 < port <= low - 5 for port in firsts)
    assert len(set(ports)) == len(ports)


def test_a_handed_out_block_is_bindable() -> None:
    first = free_ports(3)
    socks = [socket.socket() for _ in range(3)]
    try:
        for i, sock in enumerate(socks):
            sock.bind(("127.0.0.1", first + i))
    finally:
        for sock in socks:
            sock.close()


def listening_socket(start: int) -> socket.socket:
    for port in range(start, start + 1000):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock
    raise RuntimeError("no free port to listen on")


def test_a_port_held_by_a_listener_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    held = listening_socket(21000)
    other = listening_socket(22000)
    taken, free = held.getsockname()[1], other.getsockname()[1]
    other.close()
    draws = iter([taken, free])
    monkeypatch.setattr(ports_module.random, "randrange", lambda *_args: next(draws))
    try:
        assert free_ports(1) == free
    finally:
        held.close()
