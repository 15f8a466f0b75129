"""The worker's auto thread count: the affinity mask lowered to the CFS quota of its cgroup
path, read from cgroup trees written here the way the kernel lays them out (v2 and v1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.worker import cpu_threads
from services.worker.cpu_threads import available_cpus, cpu_quota, worker_threads


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_takes_the_tightest_quota_along_the_path(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root / "cpu.max", "max 100000\n")  # the root: unlimited
    write(root / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")  # the pod: 2.5 CPUs
    write(root / "kubepods" / "pod1" / "ctr" / "cpu.max", "max 100000\n")
    proc = tmp_path / "self_cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    assert cpu_quota(root, proc) == 2.5


def test_v2_inside_a_cgroup_namespace(tmp_path: Path) -> None:
    """A container sees its own cgroup as the root and `0::/` as its path."""
    root = tmp_path / "cgroup"
    write(root / "cpu.max", "150000 100000\n")
    proc = tmp_path / "self_cgroup"
    write(proc, "0::/\n")
    assert cpu_quota(root, proc) == 1.5


def test_v1_without_a_namespace_walks_up_to_the_mounts_root(tmp_path: Path) -> None:
    """Docker on cgroup v1: /proc/self/cgroup names the host's path, the mount holds only the
    container's own cgroup at its root."""
    root = tmp_path / "cgroup"
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "100000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(root / "memory" / "memory.limit_in_bytes", "1\n")
    proc = tmp_path / "self_cgroup"
    write(proc, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpu_quota(root, proc) == 1.0


def test_no_quota_or_nothing_readable_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "self_cgroup"
    write(proc, "3:cpu,cpuacct:/user.slice\n")
    assert cpu_quota(root, proc) is None
    assert cpu_quota(root, tmp_path / "missing") is None
    write(proc, "garbage\n0::/x\n")
    assert cpu_quota(root, proc) is None
    write(root / "x" / "cpu.max", "lots 0\n")  # unreadable values count as no quota
    write(root / "cpu.max", "100000 0\n")
    assert cpu_quota(root, proc) is None


def test_the_count_follows_mask_quota_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    mask = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: None)
    assert available_cpus() == mask
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: 0.5)
    assert available_cpus() == 1  # at least one thread
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: mask + 0.9)
    assert available_cpus() == mask  # a quota above the mask does not add threads
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: 64.0)
    assert worker_threads(0) == mask
    assert worker_threads(0, tp=2) == max(1, mask // 2)  # the ranks share the CPUs
    assert worker_threads(3, tp=2) == 3  # MESHLLM_NUM_THREADS wins
