"""Bound oneDNN's per-shape caches, before torch is imported.

bf16 linears on CPU run oneDNN (packed_linear.py, and inductor's frozen graphs on the compiled
path). oneDNN JIT-compiles a primitive for every distinct matrix shape and keeps it in two LRU
caches of 1,024 entries by default: its own primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`)
and the one of PyTorch's ideep wrapper (`LRU_CACHE_CAPACITY`). A serving worker's token count
varies with every prefill chunk, so each new count adds entries of ~0.3 MB until both caches
are full: measured on the dev VM (SmolLM2 shapes, bf16, 1,024 distinct row counts through two
packed linears), RSS +490 MB with the defaults, +7 MB with both at 16. That is the slow creep
of the worker's RSS in the CPU soaks (bench/RESULTS.md, #38). A step's hot shapes (decode
batches, the LM head) are a few dozen entries, so a bound of `MESHLLM_ONEDNN_CACHE_ENTRIES`
(128) keeps them cached and only evicts one-off prefill shapes, which were compiled once anyway.

Both variables are read when the libraries initialise, so the worker sets them first thing
(services/worker/__main__.py); a value already in the environment wins.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(entries: int) -> None:
    """Set both caches' capacity to `entries` where the environment does not already say."""
    if "torch" in sys.modules:
        log.warning("torch already imported: oneDNN's cache capacities are left as they are")
        return
    for name in CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
