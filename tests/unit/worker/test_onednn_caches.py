"""services/worker/onednn_caches.py: bounding oneDNN's per-shape caches keeps a bf16 CPU
worker's RSS from growing with every new token count; a capacity already in the environment
wins. Each case runs in its own interpreter (the capacities are read when torch loads)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.worker.models.packed_linear import packing_supported

ROOT = str(Path(__file__).resolve().parents[3])

# Packed bf16 linears (the worker's CPU path) at SmolLM2's MLP shapes, one call per row count
# 1..160: every count is a new oneDNN primitive. Prints the RSS growth in MB.
DISTINCT_SHAPES = textwrap.dedent(
    """
    import os, sys
    from services.worker.onednn_caches import bound_onednn_caches
    bound_onednn_caches(int(sys.argv[1]))
    import torch
    torch.set_num_threads(1)
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * page / 1e6
    pack = torch.ops.mkldnn._reorder_linear_weight
    up = pack(torch.randn(1536, 576, dtype=torch.bfloat16))
    down = pack(torch.randn(576, 1536, dtype=torch.bfloat16))
    def linear(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    x = torch.randn(160, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        linear(linear(x[:1], up), down)
        before = rss()
        for rows in range(2, 161):
            linear(linear(x[:rows], up), down)
    print(rss() - before)
    """
)


def rss_growth_mb(entries: int, preset: dict[str, str] | None = None) -> float:
    env = {"PYTHONPATH": ROOT, "PATH": os.environ.get("PATH", "")}
    # Outputs freed back to the OS at once, so heap reuse does not blur the caches' share.
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env.update(preset or {})
    out = subprocess.run(
        [sys.executable, "-c", DISTINCT_SHAPES, str(entries)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    )
    return float(out.stdout.split()[-1])


pytestmark = pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="this CPU or torch build has no oneDNN bf16 linears (the path this bounds)",
)


def test_bounded_caches_stop_the_growth_that_the_library_defaults_allow() -> None:
    defaults = rss_growth_mb(1024)  # the libraries' own capacity
    bounded = rss_growth_mb(16)
    assert defaults > 40, f"159 new shapes grew RSS by only {defaults:.1f} MB at the defaults"
    assert bounded < defaults / 4, (bounded, defaults)


def test_a_capacity_already_in_the_environment_wins() -> None:
    preset = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}
    assert rss_growth_mb(16, preset) > 4 * rss_growth_mb(16)
