"""The KV tier adds its two transfer threads to a worker, and nothing else: no OpenMP team.

torch's parallel CPU ops give every OS thread that runs one a team of OpenMP threads. The
worker runs all its torch work on one step thread (services/worker/runner/step_thread.py);
when the tier's staging buffer was filled on the event loop's thread instead, that thread got
a second team, the OpenMP runtime stopped spinning at its barriers (more threads than cores)
and every forward on a 2-core machine ran 1.5-2.5x slower with the tier on. Two real worker
processes with two torch threads each, tier off and on: the one with the tier has exactly its
store and load threads more.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.mesh import Mesh
from tests.support.tiny_llama import make_tiny_llama

pytestmark = [pytest.mark.e2e]


def os_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_the_kv_tier_adds_only_its_transfer_threads(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "tiny")
    counts: dict[str, int] = {}
    for offload in ("false", "true"):
        env = {
            "MESHLLM_MODEL": str(tmp_path / "tiny"),
            "MESHLLM_SERVED_MODEL_NAME": "tiny",
            "MESHLLM_DTYPE": "float32",
            "MESHLLM_MAX_MODEL_LEN": "64",
            "MESHLLM_KV_CACHE_BYTES": str(4 * 2**20),
            "MESHLLM_NUM_THREADS": "2",  # a team of two: a second team would show
            "MESHLLM_CPU_COMPILE": "off",
            "MESHLLM_KV_OFFLOAD": offload,
        }
        with Mesh(services=("worker",), env=env) as mesh:
            pid = mesh.procs["worker"].pid
            time.sleep(1.0)  # anything started lazily after readiness has started
            counts[offload] = os_threads(pid)
    assert counts["true"] == counts["false"] + 2, counts
