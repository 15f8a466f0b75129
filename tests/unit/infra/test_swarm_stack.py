"""infra/swarm: the stack file rendered from docker-compose.yml + the Swarm overlays is one the
real `docker stack` loader accepts (`docker stack config`, offline), and says what the
deployment needs: worker groups paired by task slot, secrets from files only, stop-first groups,
no admin port published, GPU groups placed on GPU nodes."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.swarm.secrets import SECRET_NAMES, password_secret, plan_secrets
from infra.swarm.stack_file import (
    GPU_OVERLAY,
    STACK_OVERLAY,
    StackError,
    compose_model,
    to_stack,
)
from tests.unit.infra.compose_cli import COMPOSE_FILE, clean_env, compose_binary

REPO = Path(__file__).resolve().parents[3]
TEST_OVERLAY = REPO / "infra" / "swarm" / "test.yml"
TEST_ENV = REPO / "infra" / "docker" / "test.env"
MESH = ("gateway", "scheduler", "worker", "grammar", "kvstore")
GROUP_SERVICES = ("scheduler", "worker")


def docker_cli() -> str:
    binary = shutil.which("docker")
    if binary is None:
        raise RuntimeError("the docker client is needed to check stack files (apt: docker.io)")
    return binary


def stack_config(text: str) -> subprocess.CompletedProcess[str]:
    """The docker CLI's own stack loader, offline (`docker stack config` contacts no daemon)."""
    return subprocess.run(
        [docker_cli(), "stack", "config", "-c", "-"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env({"DOCKER_HOST": "unix:///nonexistent.sock"}),
    )


def render(
    overlays: tuple[Path, ...] = (STACK_OVERLAY,),
    profiles: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    env_file: Path | None = None,
) -> dict[str, Any]:
    """The rendered stack, with compose interpolating from exactly `env` (no developer's
    MESHLLM_* variables)."""
    import os

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(clean_env(env))
    try:
        model = compose_model(
            overlays, profiles=profiles, env_file=env_file, compose=(str(compose_binary()),)
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return to_stack(model)


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    return render()


@pytest.fixture(scope="module")
def gpu_stack() -> dict[str, Any]:
    return render((STACK_OVERLAY, GPU_OVERLAY), profiles=("gpu",))


def test_docker_stack_loader_refuses_the_compose_file_itself() -> None:
    """Why the stack is rendered: the v3 loader rejects compose-spec keys our file uses."""
    result = stack_config(COMPOSE_FILE.read_text())
    assert result.returncode != 0
    assert "must be a list" in result.stderr or "not allowed" in result.stderr, result.stderr


@pytest.mark.parametrize("variant", ["default", "gpu", "test"])
def test_docker_stack_loader_accepts_the_rendered_stack(variant: str) -> None:
    if variant == "gpu":
        rendered = render((STACK_OVERLAY, GPU_OVERLAY), profiles=("gpu",))
    elif variant == "test":
        rendered = render((STACK_OVERLAY, TEST_OVERLAY), env_file=TEST_ENV)
    else:
        rendered = render()
    result = stack_config(yaml.safe_dump(rendered))
    assert result.returncode == 0, result.stderr
    loaded = yaml.safe_load(result.stdout)
    assert set(loaded["services"]) == set(rendered["services"])


def test_stack_loader_sees_templates_and_shell_dollars_intact(stack: dict[str, Any]) -> None:
    """compose config keeps `$$` escaped for the stack loader's own interpolation pass."""
    loaded = yaml.safe_load(stack_config(yaml.safe_dump(stack)).stdout)
    probe = loaded["services"]["redis"]["healthcheck"]["test"][1]
    assert '"$(cat /run/secrets/meshllm_redis_password_healthcheck)"' in probe
    assert loaded["services"]["worker"]["environment"]["MESHLLM_GROUP"] == "{{.Task.Slot}}"


def test_services_are_the_mesh_and_redis_without_the_acl_job(stack: dict[str, Any]) -> None:
    assert set(stack["services"]) == {*MESH, "redis"}
    for name, svc in stack["services"].items():
        assert not {"build", "depends_on", "restart", "profiles"} & set(svc), name


def test_every_named_volume_network_and_config_is_declared(stack: dict[str, Any]) -> None:
    for name, svc in stack["services"].items():
        for volume in svc.get("volumes", []):
            if volume["type"] == "volume":
                assert volume["source"] in stack["volumes"], (name, volume)
        for config in svc.get("configs", []):
            assert config["source"] in stack["configs"], (name, config)
        for network in svc.get("networks", {}):
            assert network in stack["networks"], (name, network)
    assert stack["volumes"] == {"model-cache": {}, "redis-acl": {}}


def test_groups_pair_scheduler_and_worker_by_task_slot(stack: dict[str, Any]) -> None:
    scheduler, worker = (stack["services"][s] for s in GROUP_SERVICES)
    for svc in (scheduler, worker):
        assert svc["environment"]["MESHLLM_GROUP"] == "{{.Task.Slot}}"
        assert svc["deploy"]["update_config"]["order"] == "stop-first"
        assert svc["deploy"]["endpoint_mode"] == "dnsrr"
    assert scheduler["deploy"]["replicas"] == worker["deploy"]["replicas"] == 1
    more = render(env={"MESHLLM_GROUPS": "3"})
    assert {more["services"][s]["deploy"]["replicas"] for s in GROUP_SERVICES} == {3}


def test_update_orders_and_restart_policies(stack: dict[str, Any]) -> None:
    for name in MESH:
        deploy = stack["services"][name]["deploy"]
        assert deploy["restart_policy"]["condition"] == "any", name
        assert deploy["update_config"]["failure_action"] == "rollback", name
        assert deploy["rollback_config"]["failure_action"] == "pause", name
    for name in ("gateway", "grammar"):
        assert stack["services"][name]["deploy"]["update_config"]["order"] == "start-first"
    assert stack["services"]["kvstore"]["deploy"]["update_config"]["order"] == "stop-first"
    assert stack["services"]["redis"]["deploy"]["update_config"]["order"] == "stop-first"


def test_health_checks_are_on_ready(stack: dict[str, Any]) -> None:
    for name in MESH:
        check = stack["services"][name]["healthcheck"]
        assert check["test"] == ["CMD", "python", "-m", "infra.healthcheck"], name


def test_only_the_gateway_api_is_published(stack: dict[str, Any]) -> None:
    published = {n: s["ports"] for n, s in stack["services"].items() if s.get("ports")}
    assert list(published) == ["gateway"]
    (port,) = published["gateway"]
    assert port == {"mode": "ingress", "target": 8000, "published": 8000, "protocol": "tcp"}


def test_secrets_are_files_never_environment_values(stack: dict[str, Any]) -> None:
    declared = stack["secrets"]
    assert set(declared) == set(SECRET_NAMES)
    assert all(spec == {"name": name, "external": True} for name, spec in declared.items())
    for name in MESH:
        svc = stack["services"][name]
        env = svc["environment"]
        mounted = {ref["source"]: ref for ref in svc["secrets"]}
        assert env["MESHLLM_REDIS_URL"] == f"redis://{name}@redis:6379/0"
        assert env["MESHLLM_REDIS_PASSWORD_FILE"] == f"/run/secrets/{password_secret(name)}"
        assert env["MESHLLM_ADMIN_TOKEN_FILE"] == "/run/secrets/meshllm_admin_token"
        assert env["MESHLLM_ADMIN_TOKEN"] == "" and env["MESHLLM_REDIS_PASSWORD"] == ""
        assert {password_secret(name), "meshllm_admin_token"} <= set(mounted), name
        for ref in mounted.values():  # readable by the image's user only
            assert (ref["uid"], ref["mode"]) == ("10001", 0o400), (name, ref)
    gateway = stack["services"]["gateway"]
    assert gateway["environment"]["MESHLLM_API_KEYS_FILE"] == "/run/secrets/meshllm_api_keys"
    redis = stack["services"]["redis"]
    assert "--aclfile /run/secrets/meshllm_redis_acl" in " ".join(redis["command"])
    assert redis["environment"]["MESHLLM_REDIS_PASSWORD_HEALTHCHECK"] == ""


def test_no_password_from_the_users_shell_reaches_the_stack() -> None:
    """The compose `redis-acl` job reads MESHLLM_REDIS_PASSWORD_*: it is not in the stack, so a
    password exported while rendering ends up nowhere in the service specs."""
    rendered = yaml.safe_dump(render(env={"MESHLLM_REDIS_PASSWORD_WORKER": "exported-pw"}))
    assert "exported-pw" not in rendered
    assert "meshllm-dev-" not in rendered


def test_gpu_groups_are_placed_on_gpu_nodes(gpu_stack: dict[str, Any]) -> None:
    worker = gpu_stack["services"]["worker-gpu"]
    scheduler = gpu_stack["services"]["scheduler-gpu"]
    assert worker["image"] != gpu_stack["services"]["worker"]["image"]  # the CUDA image
    assert worker["environment"]["MESHLLM_DEVICE"] == "cuda"
    for svc in (worker, scheduler):
        assert svc["environment"]["MESHLLM_GROUP"] == "gpu-{{.Task.Slot}}"
        assert svc["deploy"]["update_config"]["order"] == "stop-first"
    deploy = worker["deploy"]
    assert deploy["placement"]["constraints"] == ["node.labels.meshllm.gpu == true"]
    reservations = deploy["resources"]["reservations"]
    assert "devices" not in reservations
    assert reservations["generic_resources"] == [
        {"discrete_resource_spec": {"kind": "NVIDIA-GPU", "value": 1}}
    ]
    assert "placement" not in gpu_stack["services"]["worker"]["deploy"]


def test_a_device_reservation_without_placement_is_refused() -> None:
    model = {
        "services": {
            "w": {
                "image": "x",
                "deploy": {"resources": {"reservations": {"devices": [{"driver": "nvidia"}]}}},
            }
        }
    }
    with pytest.raises(StackError, match="reserves devices"):
        to_stack(model)


def test_test_overlay_publishes_the_gateway_in_host_mode() -> None:
    rendered = render((STACK_OVERLAY, TEST_OVERLAY), env_file=TEST_ENV)
    gateway = rendered["services"]["gateway"]
    assert gateway["ports"] == [
        {"mode": "host", "target": 8000, "published": 18100, "protocol": "tcp"}
    ]
    assert gateway["deploy"]["endpoint_mode"] == "dnsrr"
    assert gateway["image"] == "meshllm:cpu-test"


def test_secret_plan_renders_the_acl_from_the_same_passwords() -> None:
    tokens = iter(f"generated-{i}" for i in range(100))
    values, generated = plan_secrets(
        {"MESHLLM_REDIS_PASSWORD_WORKER": "given-worker", "MESHLLM_API_KEYS": "k1,k2"},
        token=lambda: next(tokens),
    )
    assert set(values) == set(SECRET_NAMES)
    assert values[password_secret("worker")] == "given-worker"
    assert values["meshllm_api_keys"] == "k1,k2"
    assert "meshllm_api_keys" not in generated and "meshllm_admin_token" in generated
    acl = {line.split()[1]: line for line in values["meshllm_redis_acl"].splitlines()}
    for user in ("gateway", "scheduler", "worker", "grammar", "kvstore", "healthcheck"):
        password = values[password_secret(user)]
        assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in acl[user], user
        assert password not in values["meshllm_redis_acl"]
    assert "admin" not in acl
    with_admin, _ = plan_secrets({"MESHLLM_REDIS_PASSWORD_ADMIN": "op"})
    assert "user admin on" in with_admin["meshllm_redis_acl"]
    generated_key = plan_secrets({})[0]["meshllm_api_keys"]
    assert generated_key.startswith("sk-meshllm-") and len(generated_key) > 30
