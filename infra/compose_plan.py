"""Turn docker-compose.yml into a plan of local processes (the pure half of the launcher).

The compose file stays the single source of truth: for each mesh service (a `command` of the
form `python -m services.<name>`) the plan takes its command and its `environment:`, resolves
compose interpolation (`${VAR:-default}` and friends) against the user's environment, and
rewrites container host names to loopback:
- `redis:6379` becomes the launcher's private redis-server;
- `<service>:<container port>` becomes `127.0.0.1:<that service's local port>`;
- a service listens locally on the host port compose publishes it on (`ports:`), so replicas
  like `scheduler-gpu` (host port 8011) do not collide; `port_offset` shifts every port;
- each service's MESHLLM_INSTANCE_ID is its compose name unless the file sets one.
Only URL-valued settings (`scheme://host:port`) are rewritten, so a user name that equals a
service name (`redis://gateway:pw@redis:6379`) is left alone.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

REDIS_SERVICE = "redis"
ACL_SERVICE = "redis-acl"
MODULE_PREFIX = "services."

LOCAL_DEFAULTS: dict[str, str] = {
    # Container paths and addresses that make no sense on a laptop; a user's value still wins.
    "MESHLLM_HOST": "127.0.0.1",
    "MESHLLM_MODEL_CACHE_DIR": str(
        Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "meshllm"
    ),
}

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class ComposeError(ValueError):
    """The compose file cannot be turned into a local plan (bad interpolation, no command)."""


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose variable interpolation: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e},
    ${VAR?e}, ${VAR:+a}, ${VAR+a}. An unset plain variable is empty, as in compose."""

    def replace(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        current = env.get(name)
        if op is None:
            return current or ""
        unset_or_empty = current is None or (op.startswith(":") and current == "")
        kind = op[-1]
        if kind == "-":
            return arg if unset_or_empty else (current or "")
        if kind == "?":
            if unset_or_empty:
                raise ComposeError(f"required variable {name} is missing: {arg}")
            return current or ""
        return "" if unset_or_empty else arg  # "+"

    return _VAR.sub(replace, value)


@dataclass(frozen=True)
class LocalService:
    """One mesh service as a local process."""

    name: str  # the compose service name (e.g. scheduler-gpu)
    module: str  # services.scheduler
    command: tuple[str, ...]  # the compose command, split
    env: dict[str, str]  # resolved compose environment, hosts rewritten
    port: int  # local HTTP port (admin app; the gateway's API too)
    container_port: int

    def argv(self, python: str) -> list[str]:
        """The command with compose's `python` replaced by this launcher's interpreter."""
        head, *rest = self.command
        return [python if head in ("python", "python3") else head, *rest]


def load_compose(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    return data


def active(service: Mapping[str, Any], profiles: frozenset[str]) -> bool:
    """Compose's rule: a service without profiles always runs; one with profiles runs only
    when one of them is enabled."""
    own = service.get("profiles") or []
    return not own or bool(profiles.intersection(own))


def mesh_command(service: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The split command when it runs a meshllm service module, else None (redis, jobs)."""
    command = service.get("command")
    if command is None:
        return None
    parts = tuple(shlex.split(command) if isinstance(command, str) else map(str, command))
    if len(parts) >= 3 and parts[1] == "-m" and parts[2].startswith(MODULE_PREFIX):
        return parts
    return None


def environment(service: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """The service's `environment:` (map or list form), interpolated."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    out: dict[str, str] = {}
    for key, value in raw.items():
        if value is None:  # `- VAR` passes the caller's value through
            if key in env:
                out[key] = env[key]
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        out[str(key)] = interpolate(str(value), env)
    return out


def published_port(service: Mapping[str, Any], container_port: int, env: Mapping[str, str]) -> int:
    """The host port compose publishes `container_port` on, or the container port itself."""
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            if int(entry.get("target", -1)) == container_port and entry.get("published"):
                return int(interpolate(str(entry["published"]), env))
            continue
        spec = interpolate(str(entry), env).split("/")[0]
        pieces = spec.rsplit(":", 2)
        if len(pieces) >= 2 and int(pieces[-1]) == container_port and pieces[-2]:
            return int(pieces[-2])
    return container_port


def rewrite_url(value: str, hosts: Mapping[tuple[str, int], tuple[str, int]]) -> str:
    """Rewrite `scheme://[user:pw@]host:port...` when (host, port) is a known container."""
    if "://" not in value:
        return value
    parts = urlsplit(value)
    try:
        key = (parts.hostname or "", parts.port or 0)
    except ValueError:
        return value
    if key not in hosts:
        return value
    host, port = hosts[key]
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def interpolation_env(user_env: Mapping[str, str]) -> dict[str, str]:
    """The user's environment over the launcher's local defaults."""
    return {**LOCAL_DEFAULTS, **user_env}


def plan(
    compose: Mapping[str, Any],
    user_env: Mapping[str, str],
    *,
    redis_port: int = 6379,
    port_offset: int = 0,
    profiles: frozenset[str] = frozenset(),
) -> list[LocalService]:
    """The local processes for the active mesh services, in compose file order."""
    env = interpolation_env(user_env)
    services: dict[str, Any] = compose["services"]
    chosen: list[tuple[str, tuple[str, ...], dict[str, str], int, int]] = []
    for name, spec in services.items():
        command = mesh_command(spec)
        if command is None or not active(spec, profiles):
            continue
        service_env = environment(spec, env)
        if "MESHLLM_PORT" not in service_env:
            raise ComposeError(f"service {name}: MESHLLM_PORT is not set in its environment")
        container_port = int(service_env["MESHLLM_PORT"])
        local_port = published_port(spec, container_port, env) + port_offset
        chosen.append((name, command, service_env, container_port, local_port))

    hosts: dict[tuple[str, int], tuple[str, int]] = {
        (REDIS_SERVICE, 6379): ("127.0.0.1", redis_port)
    }
    for name, _, _, container_port, local_port in chosen:
        hosts[(name, container_port)] = ("127.0.0.1", local_port)

    result = []
    for name, command, service_env, container_port, local_port in chosen:
        resolved = {k: rewrite_url(v, hosts) for k, v in service_env.items()}
        resolved["MESHLLM_PORT"] = str(local_port)
        # One host runs every service here, so the hostname default would name them all alike;
        # the service name is unique and stable across restarts (stream group consumer names).
        resolved.setdefault("MESHLLM_INSTANCE_ID", name)
        result.append(
            LocalService(
                name=name,
                module=command[2],
                command=command,
                env=resolved,
                port=local_port,
                container_port=container_port,
            )
        )
    return result


GROUP_SERVICES = ("scheduler", "worker")
"""The compose services that make up the default worker group, which `replicate` copies."""
GROUP_PORT_STRIDE = 100
"""Group i's services listen `i * GROUP_PORT_STRIDE` above group 0's (8101, 8102, ...)."""


def replicate(services: list[LocalService], replicas: int) -> list[LocalService]:
    """`replicas` worker groups instead of one: groups 1.. are copies of the default group's
    services (`scheduler-<i>`, `worker-<i>`: MESHLLM_GROUP=i, their own instance ids and ports
    offset by i * GROUP_PORT_STRIDE), placed after the originals."""
    if replicas < 1:
        raise ComposeError(f"replicas must be at least 1, got {replicas}")
    out = list(services)
    for i in range(1, replicas):
        for service in services:
            if service.name not in GROUP_SERVICES:
                continue
            port = service.port + i * GROUP_PORT_STRIDE
            name = f"{service.name}-{i}"
            env = {**service.env, "MESHLLM_GROUP": str(i), "MESHLLM_PORT": str(port)}
            env["MESHLLM_INSTANCE_ID"] = name
            out.append(
                LocalService(
                    name=name,
                    module=service.module,
                    command=service.command,
                    env=env,
                    port=port,
                    container_port=service.container_port,
                )
            )
    return out


def acl_environment(compose: Mapping[str, Any], user_env: Mapping[str, str]) -> dict[str, str]:
    """The password variables the compose `redis-acl` job renders the ACL file from."""
    spec = compose["services"].get(ACL_SERVICE, {})
    return environment(spec, interpolation_env(user_env))
