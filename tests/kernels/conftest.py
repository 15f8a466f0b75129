"""Kernel tests: compiled Triton on a GPU, Triton's interpreter on CPU tensors elsewhere.

TRITON_INTERPRET must be set before triton (or any meshllm_kernels.* module, whose @triton.jit runs
at import) is imported, so it is set here, at collection time of this directory. On a machine with
CUDA the same tests run compiled on the GPU (the `device` fixture).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
