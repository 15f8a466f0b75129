"""Render the Swarm stack file: docker-compose.yml + infra/swarm overlays -> `docker stack deploy`.

`docker stack deploy` reads only the v3 file format: it refuses compose-spec keys our compose
file uses (`profiles`, `depends_on` conditions, device reservations) and ignores others with a
warning. `docker compose config` does the part Swarm cannot (merges the overlays, interpolates
`${VAR:-default}`, applies profiles and `!reset`); `to_stack` then keeps what a stack file
may say. The result still goes through the stack loader, so compose's output keeps `$$` escapes
(`docker stack deploy` interpolates once more) and Swarm's `{{.Task.Slot}}` templates pass
through untouched.

    python -m infra.swarm.stack_file [--gpu] [--env-file F] [-f OVERLAY]... \\
        | docker stack deploy -c - meshllm
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
STACK_OVERLAY = REPO / "infra" / "swarm" / "stack.yml"
GPU_OVERLAY = REPO / "infra" / "swarm" / "gpu.yml"
STACK_VERSION = "3.8"

# Service keys a v3.8 stack file accepts. Left out: build (stacks run built images), depends_on
# and restart (Swarm orders nothing and restarts by deploy.restart_policy), profiles (applied by
# compose config already), pull_policy, container_name.
SERVICE_KEYS = frozenset(
    {
        "cap_add", "cap_drop", "command", "configs", "deploy", "entrypoint", "environment",
        "extra_hosts", "healthcheck", "hostname", "image", "init", "labels", "logging",
        "networks", "ports", "secrets", "stop_grace_period", "stop_signal", "sysctls", "tmpfs",
        "ulimits", "user", "volumes", "working_dir",
    }
)  # fmt: skip
PORT_KEYS = frozenset({"target", "published", "protocol", "mode"})  # no host_ip on a swarm
SECRETS_DIR = "/run/secrets/"
HEALTHCHECK_KEYS = frozenset({"test", "interval", "timeout", "retries", "start_period", "disable"})


class StackError(ValueError):
    """The compose model has something a stack cannot express."""


def _drop_empty(value: Any) -> Any:
    """Remove None and empty mappings (compose config writes `placement: {}` and the like)."""
    if isinstance(value, Mapping):
        out = {k: _drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    if isinstance(value, list):
        return [_drop_empty(v) for v in value]
    return value


def _mode(value: Any) -> Any:
    """compose config writes a file mode as an octal string ("0400"); stacks want a number."""
    return int(value, 8) if isinstance(value, str) else value


def _file_ref(ref: Mapping[str, Any]) -> dict[str, Any]:
    """A secret/config reference; a secret's target relative to /run/secrets, which every
    engine version takes (compose config writes the absolute path)."""
    out = {**ref, "mode": _mode(ref.get("mode"))}
    target = out.get("target")
    if isinstance(target, str) and target.startswith(SECRETS_DIR):
        out["target"] = target.removeprefix(SECRETS_DIR)
    return out


def _ports(ports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for port in ports:
        entry = {k: v for k, v in port.items() if k in PORT_KEYS}
        if "published" in entry:
            entry["published"] = int(entry["published"])
        out.append(entry)
    return out


def _volumes(volumes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for volume in volumes:
        entry = dict(volume)
        if isinstance(entry.get("bind"), Mapping):  # create_host_path is compose-only
            entry["bind"] = {k: v for k, v in entry["bind"].items() if k == "propagation"}
        if isinstance(entry.get("volume"), Mapping):
            entry["volume"] = {k: v for k, v in entry["volume"].items() if k == "nocopy"}
        out.append(entry)
    return out


def _deploy(name: str, deploy: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(deploy))  # a deep copy of plain data
    reservations = out.get("resources", {}).get("reservations", {})
    if reservations.pop("devices", None) is not None:
        # Swarm cannot reserve devices: GPU tasks go to GPU nodes by placement and generic
        # resources (infra/swarm/gpu.yml), and the node's default runtime gives them the GPU.
        constraints = out.get("placement", {}).get("constraints", [])
        generic = reservations.get("generic_resources")
        if not constraints and not generic:
            raise StackError(
                f"service {name} reserves devices, which a stack cannot: give it placement "
                "constraints or generic_resources (infra/swarm/gpu.yml)"
            )
    return out


def service_for_stack(name: str, service: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in service.items() if k in SERVICE_KEYS}
    if "image" not in out:
        raise StackError(f"service {name} has no image: a stack runs built images only")
    if "ports" in out:
        out["ports"] = _ports(out["ports"])
    if "volumes" in out:
        out["volumes"] = _volumes(out["volumes"])
    if "healthcheck" in out:
        out["healthcheck"] = {k: v for k, v in out["healthcheck"].items() if k in HEALTHCHECK_KEYS}
    if "deploy" in out:
        out["deploy"] = _deploy(name, out["deploy"])
    for key in ("secrets", "configs"):
        if key in out:
            out[key] = [_file_ref(ref) for ref in out[key]]
    return _drop_empty(out)


def _resources(kind: str, items: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level networks/volumes/configs/secrets. compose config names each after its project
    (`meshllm_default`); a stack namespaces them itself, so the name goes unless external."""
    out = {}
    for key, spec in items.items():
        entry = dict(spec or {})
        if not entry.get("external"):
            entry.pop("name", None)
        out[key] = _drop_empty(entry)  # an empty entry stays: `model-cache: {}` declares it
    return out


def to_stack(model: Mapping[str, Any]) -> dict[str, Any]:
    """A v3.8 stack file from the compose model `docker compose config --format json` prints."""
    stack: dict[str, Any] = {"version": STACK_VERSION, "services": {}}
    for name, service in model["services"].items():
        stack["services"][name] = service_for_stack(name, service)
    for kind in ("networks", "volumes", "configs", "secrets"):
        if model.get(kind):
            stack[kind] = _resources(kind, model[kind])
    return stack


def compose_model(
    overlays: Sequence[Path],
    *,
    profiles: Sequence[str] = (),
    env_file: Path | None = None,
    compose: Sequence[str] = ("docker", "compose"),
) -> dict[str, Any]:
    """`docker compose config` of docker-compose.yml with `overlays`, as data."""
    cmd = [*compose, "--project-directory", str(REPO), "-f", str(COMPOSE_FILE)]
    for overlay in overlays:
        cmd += ["-f", str(overlay)]
    for profile in profiles:
        cmd += ["--profile", profile]
    if env_file is not None:
        cmd += ["--env-file", str(env_file)]
    result = subprocess.run(
        [*cmd, "config", "--format", "json"], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise StackError(f"docker compose config failed:\n{result.stderr}")
    return dict(json.loads(result.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpu", action="store_true", help="add GPU worker groups (gpu.yml)")
    parser.add_argument("--env-file", type=Path, help="compose --env-file for interpolation")
    parser.add_argument(
        "-f", dest="overlays", type=Path, action="append", default=[], help="another overlay"
    )
    args = parser.parse_args(argv)
    overlays = [STACK_OVERLAY, *([GPU_OVERLAY] if args.gpu else []), *args.overlays]
    model = compose_model(overlays, profiles=("gpu",) if args.gpu else (), env_file=args.env_file)
    yaml.safe_dump(to_stack(model), sys.stdout, sort_keys=False, width=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
