"""Tests that need a CUDA GPU (the worker's compiled Triton path, CUDA graphs, bf16 at 8B size).

CI has no GPU: on a machine without CUDA these modules are not collected at all (collect_ignore
below), so nothing is reported as skipped. They are run on the lent H200 with the device tool
(`bash bench/gpu/run.sh tests` runs them with tests/kernels, from the offline bundle that
`make gpu-bundle` builds).
"""

from __future__ import annotations

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
