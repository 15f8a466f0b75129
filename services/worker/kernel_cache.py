"""Triton's compiled kernels kept in the model-cache volume (`MESHLLM_MODEL_CACHE_DIR/triton`).

A CUDA worker compiles its kernels as it starts (the warm-up compiles every kernel a step can
run, so serving steps compile none). Triton keeps what it compiled on disk, by default under
~/.triton/cache: in a container that is the container's own layer, lost whenever the container
is recreated (a new image, `docker compose up` after a change, a pod rescheduled), and every
such start compiles everything again. The model-cache volume already outlives the containers of
a host (Compose) or a group (Kubernetes), so the worker points Triton's cache into it, unless
`TRITON_CACHE_DIR` is set. Sharing is safe: Triton writes each entry under a temporary name and
renames it into place, and its keys hold the GPU target and the compiler's version, so workers
on other cards or images add entries beside each other's instead of reusing them.

Set before anything imports Triton (services/worker/__main__.py); a value already in the
environment wins.
"""

from __future__ import annotations

import os


def persist_triton_cache(model_cache_dir: str) -> str:
    """Point Triton's kernel cache at `model_cache_dir`/triton unless the environment already
    names one; the directory Triton will use."""
    return os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(model_cache_dir, "triton"))
