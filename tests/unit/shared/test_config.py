"""Settings come from MESHLLM_* environment variables, typed and validated by pydantic."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.config import (
    CommonSettings,
    GatewaySettings,
    GrammarSettings,
    KVStoreSettings,
    SchedulerSettings,
    WorkerSettings,
)

ALL_SETTINGS = (
    GatewaySettings,
    SchedulerSettings,
    WorkerSettings,
    GrammarSettings,
    KVStoreSettings,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's own MESHLLM_* variables must not leak into these tests."""
    import os

    for key in list(os.environ):
        if key.startswith("MESHLLM_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize(
    ("cls", "port"),
    [
        (GatewaySettings, 8000),
        (SchedulerSettings, 8001),
        (WorkerSettings, 8002),
        (GrammarSettings, 8003),
        (KVStoreSettings, 8004),
    ],
)
def test_default_ports_are_distinct_per_service(cls: type[CommonSettings], port: int) -> None:
    assert cls().port == port


@pytest.mark.parametrize("cls", ALL_SETTINGS)
def test_common_fields_read_from_env(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    monkeypatch.setenv("MESHLLM_REDIS_URL", "redis://u:p@example:6390/2")
    monkeypatch.setenv("MESHLLM_CLUSTER", "blue")
    monkeypatch.setenv("MESHLLM_INSTANCE_ID", "node-7")
    monkeypatch.setenv("MESHLLM_PORT", "9100")
    monkeypatch.setenv("MESHLLM_LOG_JSON", "false")
    monkeypatch.setenv("MESHLLM_HEARTBEAT_INTERVAL_S", "0.25")
    monkeypatch.setenv("MESHLLM_ADMIN_TOKEN", "s3cret")
    s = cls()
    assert s.redis_url == "redis://u:p@example:6390/2"
    assert s.cluster == "blue"
    assert s.instance_id == "node-7"
    assert s.port == 9100
    assert s.log_json is False
    assert s.heartbeat_interval_s == 0.25
    assert s.admin_token == "s3cret"


def test_instance_id_defaults_to_the_hostname_which_a_restart_keeps() -> None:
    import socket

    assert CommonSettings().instance_id == socket.gethostname()


def test_consumer_names_are_stable_per_service_group_and_instance() -> None:
    from shared.service import consumer_name

    assert consumer_name("scheduler", "0", "node-7") == consumer_name("scheduler", "0", "node-7")
    names = {
        consumer_name("scheduler", "0", "node-7"),
        consumer_name("scheduler", "gpu", "node-7"),
        consumer_name("worker", "0", "node-7"),
        consumer_name("scheduler", "0", "node-8"),
    }
    assert len(names) == 4


def test_service_specific_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("MESHLLM_ENABLE_PREFIX_CACHING", "0")
    monkeypatch.setenv("MESHLLM_KV_CACHE_BYTES", "1048576")
    monkeypatch.setenv("MESHLLM_CACHE_ENTRIES", "7")
    monkeypatch.setenv("MESHLLM_POLICY", "my.mod.Policy")
    monkeypatch.setenv("MESHLLM_DTYPE", "bfloat16")
    assert SchedulerSettings().max_num_seqs == 3
    assert SchedulerSettings().enable_prefix_caching is False
    assert WorkerSettings().kv_cache_bytes == 1048576
    assert WorkerSettings().dtype == "bfloat16"
    assert GrammarSettings().cache_entries == 7
    assert KVStoreSettings().policy == "my.mod.Policy"


def test_api_keys_are_split_and_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_API_KEYS", " k1, ,k2 ,")
    assert GatewaySettings().api_key_list == ["k1", "k2"]
    monkeypatch.setenv("MESHLLM_API_KEYS", "")
    assert GatewaySettings().api_key_list == []


def test_fields_of_other_services_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """One environment can feed every service: unknown MESHLLM_* names are not errors."""
    monkeypatch.setenv("MESHLLM_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("MESHLLM_SOMETHING_NEW", "x")
    s = KVStoreSettings()
    assert not hasattr(s, "max_num_seqs")


@pytest.mark.parametrize(
    ("var", "value", "cls"),
    [
        ("MESHLLM_PORT", "eighty", SchedulerSettings),
        ("MESHLLM_DTYPE", "float8", WorkerSettings),
        ("MESHLLM_DEVICE", "tpu", WorkerSettings),
        ("MESHLLM_LOG_JSON", "maybe", GrammarSettings),
        ("MESHLLM_HEARTBEAT_INTERVAL_S", "soon", KVStoreSettings),
        ("MESHLLM_SCHEDULE_AHEAD", "4", SchedulerSettings),  # 2..3 plans out at once
        ("MESHLLM_SCHEDULE_AHEAD", "1", SchedulerSettings),  # 1: MESHLLM_ASYNC_SCHEDULING=false
    ],
)
def test_invalid_values_are_rejected_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, cls: type
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError) as info:
        cls()
    field = var.removeprefix("MESHLLM_").lower()
    assert field in str(info.value)


def test_constructor_arguments_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_PORT", "9999")
    assert GrammarSettings(port=1234).port == 1234


def test_model_cache_dir_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/xdg-here")
    assert WorkerSettings().model_cache_dir == "/tmp/xdg-here/meshllm"
    monkeypatch.setenv("MESHLLM_MODEL_CACHE_DIR", "/data/models")
    assert WorkerSettings().model_cache_dir == "/data/models"
