"""How many CPU threads a worker's torch may use when MESHLLM_NUM_THREADS is 0 (auto).

torch's default is one thread per CPU of the process's affinity mask. A container's CPU limit
(`docker run --cpus`, a Kubernetes CPU limit) is a CFS quota instead, which the mask does not
show: a worker limited to 2 CPUs on a 64-core node would start 64 OpenMP threads and spend its
quota spinning and throttled. Auto therefore takes the smaller of the mask and the quota of the
process's cgroup and its parents (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`), rounded down, and shares it among a tensor-parallel group's ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _limits(root: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """Quotas of the cgroup at `path` under `root` and of each parent up to `root` (inside a
    container the mount's root is the container's own cgroup, whatever `path` says)."""
    found = []
    directory = root / path.lstrip("/")
    while True:
        quota = read(directory)
        if quota is not None:
            found.append(quota)
        if directory == root or root not in directory.parents:
            return found
        directory = directory.parent


def cpu_quota(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """CPUs the process's CFS quota allows (the tightest along its cgroup path); None when no
    quota applies or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:  # v2: "0::/path"
            limits += _limits(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):  # v1: "N:cpu,cpuacct:/path"
            mount = next((root / m for m in (controllers, "cpu") if (root / m).is_dir()), None)
            if mount is not None:
                limits += _limits(mount, path, _v1_quota)
    return min(limits) if limits else None


def available_cpus() -> int:
    """The affinity mask's CPU count, lowered to the CFS quota (rounded down, at least 1)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return cpus


def worker_threads(num_threads: int, tp: int = 1) -> int:
    """MESHLLM_NUM_THREADS when set, else this rank's share of the available CPUs."""
    return num_threads if num_threads > 0 else max(1, available_cpus() // max(1, tp))
