"""The rendered ACL lets services in other containers in: Redis' protected mode (on by default)
refuses every non-loopback client while the default user is `nopass`, even a disabled one, and
in compose, Swarm or Kubernetes no service is on Redis' loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from infra.redis.render_acl import redis_url, render_acl
from tests.support.redis_server import RedisServer


def own_address() -> str:
    """This host's address on its default route: a client from it is not on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent by a UDP connect
        address = str(probe.getsockname()[0])
    assert not address.startswith("127."), address
    return address


@pytest.fixture
def protected_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    acl = tmp_path / "users.acl"
    acl.write_text(render_acl({}))
    address = own_address()
    server = RedisServer(
        extra_args=[
            "--aclfile",
            str(acl),
            "--protected-mode",
            "yes",
            "--bind",
            "127.0.0.1",
            address,
        ]
    ).start()
    yield server, address
    server.stop()


def test_a_service_user_connects_from_another_address(
    protected_redis: tuple[RedisServer, str],
) -> None:
    server, address = protected_redis
    client = redis.Redis.from_url(redis_url("gateway", address, server.port, {}))
    assert client.ping() is True
    client.close()


def test_the_default_user_stays_locked_out(protected_redis: tuple[RedisServer, str]) -> None:
    server, address = protected_redis
    anonymous = redis.Redis(host=address, port=server.port)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=address, port=server.port, username="default", password="").ping()
