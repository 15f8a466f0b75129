"""A Redis password given as a secret file (MESHLLM_REDIS_PASSWORD_FILE) logs a service's ACL
user in against a real redis-server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from shared.config import SchedulerSettings
from tests.support.redis_server import RedisServer


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("MESHLLM_"):
            monkeypatch.delenv(key)


def test_password_file_authenticates_and_the_urls_own_does_not(
    own_redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """URL-special characters in the password survive the merge into the URL."""
    password = "s/cret@:#%"
    admin = redis.Redis.from_url(own_redis.url)
    admin.acl_setuser("scheduler", enabled=True, passwords=[f"+{password}"], commands=["+ping"])
    admin.close()
    monkeypatch.setenv("MESHLLM_REDIS_URL", f"redis://scheduler:stale@127.0.0.1:{own_redis.port}/0")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(SchedulerSettings().redis_url).ping()
    secret = tmp_path / "meshllm_redis_password_scheduler"
    secret.write_text(password + "\n")
    monkeypatch.setenv("MESHLLM_REDIS_PASSWORD_FILE", str(secret))
    client = redis.Redis.from_url(SchedulerSettings().redis_url)
    assert client.ping() is True
    client.close()
