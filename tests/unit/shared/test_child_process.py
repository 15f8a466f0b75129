"""shared.child_process: a child started with die_with_parent goes when its parent is killed
with SIGKILL (the gateway's planning processes used to linger, ~110 MB each, after a kill -9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PARENT = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from shared.child_process import die_with_parent

    def pid():
        return os.getpid()

    if __name__ == "__main__":
        guarded = sys.argv[1] == "guarded"
        pool = ProcessPoolExecutor(
            2,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=die_with_parent if guarded else None,
            initargs=(os.getpid(),) if guarded else (),
        )
        pids = {pool.submit(pid).result() for _ in range(8)}
        print(" ".join(map(str, sorted(pids))), flush=True)
        time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def children_after_parent_killed(tmp_path: Path, mode: str, wait_s: float) -> list[int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    parent = subprocess.Popen(
        [sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert pids and all(alive(p) for p in pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + wait_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    assert children_after_parent_killed(tmp_path, "guarded", 10) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="PR_SET_PDEATHSIG is Linux's")
def test_without_it_they_outlive_the_parent(tmp_path: Path) -> None:
    """The control: a plain pool's workers survive a SIGKILL of their parent (until their
    call queue's pipe breaks, which an idle worker never notices)."""
    left = children_after_parent_killed(tmp_path, "plain", 2)
    try:
        assert left
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
