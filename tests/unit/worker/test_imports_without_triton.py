"""The CPU worker image has no Triton (docker/): every worker module must import without it,
the Triton kernels only where a CUDA or interpreter path calls them (lazily)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

BLOCK_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoTriton())
import services.worker.service, services.worker.runner.bootstrap
import services.worker.runner.model_runner, services.worker.runner.in_flight
import services.worker.accel.cuda_graphs, services.worker.accel.decode_chain
assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
print("ok")
"""


def test_the_worker_imports_without_triton() -> None:
    child = subprocess.run(
        [sys.executable, "-c", BLOCK_TRITON], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip().endswith("ok")
