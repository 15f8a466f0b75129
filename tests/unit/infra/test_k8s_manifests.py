"""infra/k8s: every overlay renders (`kubectl kustomize`), every object passes the Kubernetes
schemas strictly (kubernetes-validate), and what the manifests name exists in the code: each
MESHLLM_* variable is a setting of the service that reads it, each port the service's, each
probe path a route of the admin app, each metric the autoscaler queries a metric the services
export. CRDs (KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor) have no schema in
kubernetes-validate: they are checked here field by field instead."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import REGISTRY
from pydantic_settings import BaseSettings

from infra.redis.render_acl import HEALTHCHECK, SERVICE_USERS
from shared.config import (
    CommonSettings,
    GatewaySettings,
    GrammarSettings,
    KVStoreSettings,
    SchedulerSettings,
    WorkerSettings,
)
from shared.service import Service
from tests.support.prometheus_names import query_names, series_names

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "infra" / "k8s"
OVERLAYS = ("cpu", "gpu", "pd")
# The oldest Kubernetes with the pod-index label the groups number themselves by, and the newest
# schemas kubernetes-validate has.
KUBERNETES_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
CRDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
SETTINGS: dict[str, type[BaseSettings]] = {
    "services.gateway": GatewaySettings,
    "services.scheduler": SchedulerSettings,
    "services.worker": WorkerSettings,
    "services.grammar": GrammarSettings,
    "services.kvstore": KVStoreSettings,
}
HELPER_VARS = {"POD_NAME", "POD_INDEX"}  # downward-API values the MESHLLM_* ones are built from
MIN_KUSTOMIZE = (4, 0)


def kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        raise RuntimeError("kubectl is not installed: `make kubectl` installs it")
    version = subprocess.run(
        [binary, "version", "--client"], capture_output=True, text=True, timeout=60
    ).stdout
    found = re.search(r"Kustomize Version: v(\d+)\.(\d+)", version)
    if found is None or tuple(map(int, found.groups())) < MIN_KUSTOMIZE:
        raise RuntimeError(
            f"kubectl's kustomize is older than v{MIN_KUSTOMIZE[0]} (components, labels): "
            f"{version.strip()!r}; use kubectl >= 1.21"
        )
    return binary


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in render(overlay) if o["kind"] == kind]


def pod_specs(overlay: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for obj in render(overlay):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            out.append((obj["metadata"]["name"], obj["spec"]["template"]["spec"]))
    return out


def meshllm_containers(overlay: str) -> list[tuple[str, dict[str, Any], type[BaseSettings]]]:
    """(workload, container, settings class) for every container running a meshllm service."""
    out = []
    for workload, spec in pod_specs(overlay):
        for container in spec["containers"]:
            command = container.get("command", [])
            if command[:2] == ["python", "-m"] and command[2] in SETTINGS:
                out.append((workload, container, SETTINGS[command[2]]))
    return out


def config_map(overlay: str) -> dict[str, str]:
    (found,) = [
        c
        for c in objects(overlay, "ConfigMap")
        if c["metadata"]["name"].startswith("meshllm-config")
    ]
    return dict(found["data"])


def setting_name(variable: str) -> str:
    return variable.removeprefix("MESHLLM_").removesuffix("_FILE").lower()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(overlay: str) -> None:
    kinds = {o["kind"] for o in render(overlay)}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret"} <= kinds
    assert {"PodDisruptionBudget", "ScaledObject", "ServiceMonitor"} <= kinds
    for obj in render(overlay):
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "meshllm", obj["metadata"]["name"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_pass_the_kubernetes_schemas(overlay: str, version: str) -> None:
    for obj in render(overlay):
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            continue  # no schema in kubernetes-validate: see the CRD tests below
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_a_typo() -> None:
    """The check bites: a misspelt field fails strict validation."""
    deployment = dict(objects("cpu", "Deployment")[0])
    deployment["spec"] = {**deployment["spec"], "replica": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_is_a_setting_of_its_service(overlay: str) -> None:
    for workload, container, settings in meshllm_containers(overlay):
        for env in container.get("env", []):
            name = env["name"]
            if name in HELPER_VARS:
                continue
            assert name.startswith("MESHLLM_"), (workload, name)
            assert setting_name(name) in settings.model_fields, (workload, container["name"], name)
    fields = set().union(*(cls.model_fields for cls in SETTINGS.values()))
    unknown = {k for k in config_map(overlay) if setting_name(k) not in fields}
    assert unknown == set(), f"{overlay}: ConfigMap keys no service reads: {unknown}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_probes_are_the_services_own(overlay: str) -> None:
    routes = {r.path for r in probe_app().routes}  # type: ignore[attr-defined]
    for workload, container, settings in meshllm_containers(overlay):
        env = {e["name"]: e.get("value") for e in container["env"]}
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        (port,) = ports.values()
        assert port == settings.model_fields["port"].default, (workload, container["name"])
        assert env["MESHLLM_PORT"] == str(port), (workload, container["name"])
        ready, alive = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
        assert (ready["path"], alive["path"]) == ("/ready", "/health")
        assert {ready["path"], alive["path"], "/metrics"} <= routes
        assert ready["port"] in ports and alive["port"] in ports
        assert container["resources"]["requests"], (workload, container["name"])


@cache
def probe_app() -> Any:
    """The admin app every service serves (shared/admin.py), for its route table."""
    from shared.admin import build_admin_app

    class Probe(Service):
        name = "gateway"

        async def run(self) -> None:
            return None

    return build_admin_app(Probe(CommonSettings()))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_named_container_ports(overlay: str) -> None:
    for svc in objects(overlay, "Service"):
        selector = svc["spec"]["selector"]
        pods = [spec for name, spec in pod_templates(overlay) if selector.items() <= name.items()]
        assert len(pods) == 1, (svc["metadata"]["name"], selector)
        names = {p["name"] for c in pods[0]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def pod_templates(overlay: str) -> list[tuple[dict[str, str], dict[str, Any]]]:
    return [
        (o["spec"]["template"]["metadata"]["labels"], o["spec"]["template"]["spec"])
        for o in render(overlay)
        if o["kind"] in ("Deployment", "StatefulSet")
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secret_and_config_references_resolve(overlay: str) -> None:
    secret = {s["metadata"]["name"]: s for s in objects(overlay, "Secret")}
    maps = {c["metadata"]["name"] for c in objects(overlay, "ConfigMap")}
    for workload, spec in pod_specs(overlay):
        for container in spec.get("initContainers", []) + spec["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in maps, workload
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["key"] in secret[ref["name"]]["stringData"], (workload, ref)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_drain_fits_the_grace_period(overlay: str) -> None:
    drain = CommonSettings.model_fields["shutdown_timeout_s"].default
    for workload, spec in pod_specs(overlay):
        if workload != "redis":
            assert spec["terminationGracePeriodSeconds"] >= drain + 10, workload


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_select_a_workload(overlay: str) -> None:
    budgets = objects(overlay, "PodDisruptionBudget")
    templates = [labels for labels, _ in pod_templates(overlay)]
    covered = 0
    for pdb in budgets:
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert sum(selector.items() <= labels.items() for labels in templates) == 1, selector
        covered += 1
    assert covered == len(templates) - 1  # every workload but the single Redis


def test_groups_number_themselves_by_pod_ordinal() -> None:
    (group,) = [
        s for s in objects("cpu", "StatefulSet") if s["metadata"]["name"] == "meshllm-group"
    ]
    containers = {c["name"]: c for c in group["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"scheduler", "worker"}  # one pod = one group
    ids = set()
    for container in containers.values():
        env = {e["name"]: e for e in container["env"]}
        index = env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert index == "metadata.labels['apps.kubernetes.io/pod-index']"
        assert env["MESHLLM_GROUP"]["value"] == "$(POD_INDEX)"
        ids.add(env["MESHLLM_INSTANCE_ID"]["value"])
    assert len(ids) == 2
    assert group["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert "replicas" not in group["spec"]  # KEDA owns the count (components/autoscaling)


def test_pd_overlay_has_prefill_and_decode_groups() -> None:
    roles = {}
    for sts in objects("pd", "StatefulSet"):
        if sts["metadata"]["name"] == "redis":
            continue
        containers = {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}
        scheduler = [(e["name"], e.get("value")) for e in containers["scheduler"]["env"]]
        (role,) = [v for n, v in scheduler if n == "MESHLLM_ROLE"]
        groups = {
            next(e["value"] for e in c["env"] if e["name"] == "MESHLLM_GROUP")
            for c in containers.values()
        }
        roles[sts["metadata"]["name"]] = (role, groups)
    assert roles == {
        "meshllm-group": ("prefill", {"$(POD_INDEX)"}),
        "meshllm-group-decode": ("decode", {"decode-$(POD_INDEX)"}),
    }
    selectors = [s["spec"]["selector"]["matchLabels"] for s in objects("pd", "StatefulSet")]
    for i, a in enumerate(selectors):
        for b in selectors[i + 1 :]:
            assert not (a.items() <= b.items() or b.items() <= a.items()), (a, b)


def test_gpu_overlay_puts_each_groups_worker_on_a_gpu() -> None:
    (group,) = [
        s for s in objects("gpu", "StatefulSet") if s["metadata"]["name"] == "meshllm-group"
    ]
    spec = group["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    worker, scheduler = containers["worker"], containers["scheduler"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in scheduler["resources"].get("limits", {})
    assert worker["image"] == "meshllm:cuda" and scheduler["image"] == "meshllm:cpu"
    assert {"name": "MESHLLM_DEVICE", "value": "cuda"} in worker["env"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_redis_keeps_the_laptop_configs_directives_but_persists() -> None:
    (redis,) = [s for s in objects("cpu", "StatefulSet") if s["metadata"]["name"] == "redis"]
    spec = redis["spec"]["template"]["spec"]
    (server,) = spec["containers"]
    args = server["args"]
    given = {args[i].removeprefix("--"): args[i + 1] for i in range(1, len(args), 2)}
    conf = {}
    for line in (REPO / "infra" / "redis" / "redis.conf").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition(" ")
            conf[key] = value.strip().strip('"')
    for key in conf.keys() - {"bind", "save", "appendonly"}:
        assert given.get(key) == conf[key], key
    assert given["appendonly"] == "yes" and given["aclfile"] == "/acl/users.acl"
    (init,) = spec["initContainers"]
    assert init["command"][:3] == ["python", "-m", "infra.redis.render_acl"]
    wanted = {u.password_env for u in (*SERVICE_USERS, HEALTHCHECK)}
    assert {e["name"] for e in init["env"]} == wanted


@cache
def exported_series() -> set[str]:
    """Every series the services can export: their modules register their metrics on import."""
    import services.gateway.service
    import services.grammar.service
    import services.kvstore.service
    import services.scheduler.service
    import services.worker.service  # noqa: F401

    return series_names({m.name: m.type for m in REGISTRY.collect()})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_objects_target_a_group_on_an_exported_metric(overlay: str) -> None:
    groups = {s["metadata"]["name"] for s in objects(overlay, "StatefulSet")} - {"redis"}
    scaled = objects(overlay, "ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == groups
    for obj in scaled:
        assert obj["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
        assert 1 <= obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        names = query_names(trigger["metadata"]["query"])
        assert names == {"meshllm:num_requests_waiting"}
        assert names <= exported_series()
        assert float(trigger["metadata"]["threshold"]) > 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_every_admin_port(overlay: str) -> None:
    (monitor,) = objects(overlay, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    for svc in objects(overlay, "Service"):
        ports = {p["name"] for p in svc["spec"]["ports"]}
        labels = svc["metadata"].get("labels", {})
        if svc["metadata"]["name"] == "redis":
            continue
        assert selector.items() <= labels.items(), svc["metadata"]["name"]
        assert ports <= scraped, svc["metadata"]["name"]
