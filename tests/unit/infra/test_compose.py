"""docker-compose.yml: valid for Docker Compose and the compose-spec schema, and coherent with
the code (every setting documented, code defaults, healthchecks, ACL passwords, GPU profile)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic_settings import BaseSettings

from infra.redis.render_acl import ADMIN, HEALTHCHECK, SERVICE_USERS
from shared.config import (
    GatewaySettings,
    GrammarSettings,
    KVStoreSettings,
    SchedulerSettings,
    WorkerSettings,
)
from tests.unit.infra.compose_cli import COMPOSE_FILE, REPO, resolved_config, run_compose

SETTINGS_BY_MODULE: dict[str, type[BaseSettings]] = {
    "services.gateway": GatewaySettings,
    "services.scheduler": SchedulerSettings,
    "services.worker": WorkerSettings,
    "services.grammar": GrammarSettings,
    "services.kvstore": KVStoreSettings,
}
NOT_IN_COMPOSE = {"instance_id"}  # the hostname (the launcher: the service name), documented
# Deliberately different from the code default in containers, with the reason in the file.
CONTAINER_VALUES = {"redis_url", "model_cache_dir"}
# The compose mesh runs a kvstore, so its schedulers switch the offload tier on (file comment).
MESH_VALUES = {("services.scheduler", "kv_offload")}


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return resolved_config(profiles=("gpu",))


def mesh_services(config: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (module, service) for every service running `python -m services.<name>`."""
    out = {}
    for name, svc in config["services"].items():
        command = svc.get("command") or []
        if command[:2] == ["python", "-m"] and command[2].startswith("services."):
            out[name] = (command[2], svc)
    return out


def test_docker_compose_config_accepts_the_file() -> None:
    result = run_compose("config", "-q")
    assert result.returncode == 0, result.stderr
    result = run_compose("config", "-q", profiles=("gpu",))
    assert result.returncode == 0, result.stderr


def test_docker_compose_config_catches_a_broken_file(tmp_path: Path) -> None:
    """The check bites: an invalid depends_on condition is refused."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("service_healthy", "service_happy", 1))
    result = run_compose("config", "-q", file=broken)
    assert result.returncode != 0
    assert "depends_on.redis.condition" in result.stderr


def test_compose_spec_schema() -> None:
    checker = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "check-jsonschema"
    binary = str(checker) if checker.exists() else "check-jsonschema"
    result = subprocess.run(
        [binary, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_mesh_service_is_there(config: dict[str, Any]) -> None:
    modules = {module for module, _ in mesh_services(config).values()}
    assert modules == set(SETTINGS_BY_MODULE)
    assert {"redis", "redis-acl"} <= set(config["services"])


def test_environment_names_every_setting_and_nothing_else(config: dict[str, Any]) -> None:
    for name, (module, svc) in mesh_services(config).items():
        fields = set(SETTINGS_BY_MODULE[module].model_fields)
        names = {k.removeprefix("MESHLLM_").lower() for k in svc["environment"]}
        assert all(k.startswith("MESHLLM_") for k in svc["environment"]), name
        assert names - fields == set(), f"{name}: unknown settings in compose"
        assert fields - NOT_IN_COMPOSE - names == set(), f"{name}: settings missing in compose"


def test_compose_defaults_are_the_code_defaults(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no user variables, each default-profile service gets exactly the code's defaults
    (apart from the container-only values), so the two cannot drift apart silently."""
    default_profile = resolved_config()
    for name, (module, svc) in mesh_services(default_profile).items():
        cls = SETTINGS_BY_MODULE[module]
        for key in [k for k in os.environ if k.startswith("MESHLLM_")]:
            monkeypatch.delenv(key)
        defaults = cls().model_dump()
        for key, value in svc["environment"].items():
            monkeypatch.setenv(key, value)
        from_compose = cls().model_dump()
        for field in set(cls.model_fields) - NOT_IN_COMPOSE - CONTAINER_VALUES:
            if (module, field) in MESH_VALUES:
                assert from_compose[field] != defaults[field], f"{name}.{field}: not needed"
                continue
            assert from_compose[field] == defaults[field], f"{name}.{field}"


def test_services_use_their_own_redis_user(config: dict[str, Any]) -> None:
    for name, (module, svc) in mesh_services(config).items():
        user = module.removeprefix("services.")
        url = svc["environment"]["MESHLLM_REDIS_URL"]
        assert url.startswith(f"redis://{user}:meshllm-dev-{user}@redis:6379/"), name


def test_healthchecks_and_start_order(config: dict[str, Any]) -> None:
    for name, (_, svc) in mesh_services(config).items():
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "infra.healthcheck"], name
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert svc["restart"] == "unless-stopped", name
    redis = config["services"]["redis"]
    assert "--aclfile" in redis["command"]
    assert "redis-cli" in " ".join(redis["healthcheck"]["test"])
    assert redis["depends_on"]["redis-acl"]["condition"] == "service_completed_successfully"
    gateway = config["services"]["gateway"]
    assert gateway["depends_on"]["grammar"]["condition"] == "service_healthy"
    assert {p["target"] for p in gateway["ports"]} == {8000}


def test_every_long_running_service_restarts_unless_stopped() -> None:
    """What the local launcher's supervision mirrors (infra/supervisor.py); only the ACL job,
    which runs once, is not restarted."""
    everything = resolved_config(profiles=("gpu", "pd"))["services"]
    for name, svc in everything.items():
        expected = "no" if name == "redis-acl" else "unless-stopped"
        assert svc.get("restart") == expected, name


def test_acl_job_gets_every_password(config: dict[str, Any]) -> None:
    job = config["services"]["redis-acl"]
    assert job["command"][:3] == ["python", "-m", "infra.redis.render_acl"]
    wanted = {u.password_env for u in (*SERVICE_USERS, HEALTHCHECK, ADMIN)}
    assert set(job["environment"]) == wanted
    assert job["environment"]["MESHLLM_REDIS_PASSWORD_ADMIN"] == ""  # no admin by default


def test_gpu_profile_adds_a_cuda_worker_group(config: dict[str, Any]) -> None:
    default_profile = resolved_config()
    assert "worker-gpu" not in default_profile["services"]
    worker = config["services"]["worker-gpu"]
    assert worker["build"]["target"] == "cuda"
    assert worker["environment"]["MESHLLM_DEVICE"] == "cuda"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    scheduler = config["services"]["scheduler-gpu"]
    assert worker["environment"]["MESHLLM_GROUP"] == scheduler["environment"]["MESHLLM_GROUP"]
    assert worker["environment"]["MESHLLM_GROUP"] != "0"


def test_user_variables_override_defaults() -> None:
    config = resolved_config({"MESHLLM_MODEL": "/models/llama", "MESHLLM_LOG_LEVEL": "DEBUG"})
    for name, (module, svc) in mesh_services(config).items():
        assert svc["environment"]["MESHLLM_LOG_LEVEL"] == "DEBUG", name
        if "model" in SETTINGS_BY_MODULE[module].model_fields:
            assert svc["environment"]["MESHLLM_MODEL"] == "/models/llama", name


def test_model_cache_is_a_named_volume(config: dict[str, Any]) -> None:
    assert "model-cache" in config["volumes"]
    for name, (module, svc) in mesh_services(config).items():
        if "model_cache_dir" not in SETTINGS_BY_MODULE[module].model_fields:
            continue
        target = svc["environment"]["MESHLLM_MODEL_CACHE_DIR"]
        mounts = {(v["source"], v["target"]) for v in svc.get("volumes", [])}
        assert ("model-cache", target) in mounts, name
