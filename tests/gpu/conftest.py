"""Tests that need a CUDA GPU (the worker's compiled Triton path, CUDA graphs, bf16 at 8B size).

Every test collected here carries the `gpu` marker (`-m gpu` selects them, `-m "not gpu"` leaves
them out). On a machine without CUDA they are still collected, and reported as skipped with the
reason below, so a CPU run shows how many GPU tests it did not run instead of hiding them. The
modules therefore import on a CPU machine (TRITON_INTERPRET=1 is set by tests/conftest.py);
CUDA work happens only inside tests and fixtures. They are run on the lent H200 with the device
tool: `bash bench/gpu/run.sh tests` runs them with tests/kernels, from the offline bundle that
`make gpu-bundle` builds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA_REASON = (
    "needs a CUDA GPU; run on the H200: bash bench/gpu/run.sh tests (make gpu-bundle first)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks of a directory's conftest see the whole session's items: mark only those here.
    cuda = torch.cuda.is_available()
    for item in items:
        if not item.path.is_relative_to(HERE):
            continue
        item.add_marker(pytest.mark.gpu)
        if not cuda:
            # First among the item's skip marks (append=False), so this reason is the one
            # reported, not a module's own skipif about the GPU's generation.
            item.add_marker(pytest.mark.skipif(True, reason=NO_CUDA_REASON), append=False)
