"""Settings from secret files: `MESHLLM_<FIELD>_FILE` (Docker/Kubernetes secrets) and the Redis
password merged into the Redis URL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.admin import describe_settings
from shared.config import (
    CommonSettings,
    GatewaySettings,
    GrammarSettings,
    KVStoreSettings,
    SchedulerSettings,
    WorkerSettings,
    with_password,
)
from shared.setting_files import SettingFileError

ALL_SETTINGS = (
    GatewaySettings,
    SchedulerSettings,
    WorkerSettings,
    GrammarSettings,
    KVStoreSettings,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("MESHLLM_"):
            monkeypatch.delenv(key)


def secret(tmp_path: Path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


@pytest.mark.parametrize("cls", ALL_SETTINGS)
def test_admin_token_and_redis_password_from_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type[CommonSettings]
) -> None:
    # `echo s3cret | docker secret create` stores the trailing newline: it is not the value.
    monkeypatch.setenv("MESHLLM_ADMIN_TOKEN_FILE", secret(tmp_path, "token", "s3cret\n"))
    monkeypatch.setenv("MESHLLM_REDIS_PASSWORD_FILE", secret(tmp_path, "pw", "hunter2\n"))
    monkeypatch.setenv("MESHLLM_REDIS_URL", "redis://scheduler@redis:6379/0")
    settings = cls()
    assert settings.admin_token == "s3cret"
    assert settings.redis_password == "hunter2"
    assert settings.redis_url == "redis://scheduler:hunter2@redis:6379/0"


def test_api_keys_and_an_integer_from_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHLLM_API_KEYS_FILE", secret(tmp_path, "keys", "k1,k2\n"))
    monkeypatch.setenv("MESHLLM_MAX_N_FILE", secret(tmp_path, "n", "3"))
    settings = GatewaySettings()
    assert settings.api_key_list == ["k1", "k2"]
    assert settings.max_n == 3


def test_a_json_list_setting_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_REASONING_END_TOKEN_IDS_FILE", secret(tmp_path, "ids", "[7, 8]\n"))
    assert SchedulerSettings().reasoning_end_token_ids == [7, 8]


def test_empty_variable_gives_way_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compose files default secrets to "": the file named beside it wins."""
    monkeypatch.setenv("MESHLLM_ADMIN_TOKEN", "")
    monkeypatch.setenv("MESHLLM_ADMIN_TOKEN_FILE", secret(tmp_path, "token", "from-file"))
    assert CommonSettings().admin_token == "from-file"


def test_value_and_file_together_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHLLM_ADMIN_TOKEN", "from-env")
    monkeypatch.setenv("MESHLLM_ADMIN_TOKEN_FILE", secret(tmp_path, "token", "from-file"))
    with pytest.raises(SettingFileError, match="MESHLLM_ADMIN_TOKEN and MESHLLM_ADMIN_TOKEN_FILE"):
        CommonSettings()


def test_unreadable_file_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nope"
    monkeypatch.setenv("MESHLLM_REDIS_PASSWORD_FILE", str(missing))
    with pytest.raises(SettingFileError, match=f"MESHLLM_REDIS_PASSWORD_FILE={missing}"):
        CommonSettings()


def test_invalid_value_in_a_file_fails_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHLLM_PORT_FILE", secret(tmp_path, "port", "not-a-port"))
    with pytest.raises(ValueError, match="port"):
        CommonSettings()


def test_without_files_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_REDIS_URL", "redis://gateway:pw@redis:6379/0")
    settings = GatewaySettings()
    assert settings.redis_url == "redis://gateway:pw@redis:6379/0"
    assert settings.admin_token == ""


@pytest.mark.parametrize(
    ("url", "password", "expected"),
    [
        ("redis://worker:old@redis:6379/0", "new", "redis://worker:new@redis:6379/0"),
        (
            "redis://worker@redis:6379/0",
            "p@ss:/w#rd",
            "redis://worker:p%40ss%3A%2Fw%23rd@redis:6379/0",
        ),
        ("redis://redis:6379", "pw", "redis://:pw@redis:6379"),
    ],
)
def test_password_replaces_the_urls(url: str, password: str, expected: str) -> None:
    assert with_password(url, password) == expected


def test_password_is_masked_in_admin_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_REDIS_PASSWORD_FILE", secret(tmp_path, "pw", "hunter2"))
    monkeypatch.setenv("MESHLLM_ADMIN_TOKEN_FILE", secret(tmp_path, "token", "s3cret"))
    described = describe_settings(SchedulerSettings())
    assert "hunter2" not in repr(described) and "s3cret" not in repr(described)
    assert described["redis_password"] == "***"
