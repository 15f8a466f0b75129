"""Which attention backend a worker's forwards run on, asked of the registry once per
configuration (meshllm_kernels/attention/backends.py; CONTRACTS: "Non-causal draft blocks").

The requirements come from the configuration, not from a step: every step of a runner needs
the same things. Sliding windows come from the model's KV cache groups, fp8 KV from the cache
dtype, non-causal query blocks from the drafter that owns the cache: the target's own forwards
are causal, and so are the chain drafters (n-gram, draft model, EAGLE, EAGLE-3, MTP: each draft
conditioned on the one before, one position per forward). The DFlash drafter
(spec/block_drafter.py) drafts a whole block at once, each query seeing the committed prefix
and the rest of the block, so its private cache (spec/row_kv.py) asks for `non_causal`; the
registry then refuses a path that cannot compute it instead of returning a causal result.

The path follows the device and the groups: CUDA with full-attention groups (one, or beside a
hybrid model's state group) runs the Triton kernels ("triton"); CPU, and sliding-window groups
on any device (groups.py builds per-group reference metadata), run the reference path
("reference"). The backend is resolved when the
runner (or a drafter's private cache) is built, so a configuration no backend can serve fails
at start-up with BackendCapabilityError, and a step only reads the resolved object. A ring-buffer
group (shared/kv/groups.py) has no path at all: refused there too (UnsupportedModelError).
"""

from __future__ import annotations

import torch

from meshllm_kernels.attention.backends import (
    AttentionBackend,
    AttentionRequirements,
    select_backend,
)
from services.worker.attention.groups import paged_attention_groups
from services.worker.attention.reference import ReferenceAttention
from shared.kv.groups import KVGroupSpec
from shared.model.config import UnsupportedModelError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def uses_triton(device: torch.device | str) -> bool:
    """The Triton kernels run on CUDA devices only (on CPU they need the interpreter)."""
    return torch.device(device).type == "cuda"


def attention_requirements(
    kv_groups: list[KVGroupSpec], kv_dtype: torch.dtype, non_causal: bool = False
) -> AttentionRequirements:
    """What every forward over these groups and this cache dtype needs (module docstring)."""
    return AttentionRequirements(
        non_causal=non_causal,
        sliding_window=any(g.sliding_window is not None for g in kv_groups),
        fp8_kv=kv_dtype in FP8_DTYPES,
    )


def backend_name(device: torch.device | str, kv_groups: list[KVGroupSpec]) -> str:
    if uses_triton(device) and paged_attention_groups(kv_groups):
        return "triton"
    return ReferenceAttention.name


def refuse_ring_groups(kv_groups: list[KVGroupSpec]) -> None:
    """No attention path here implements a ring-buffer layer (shared/kv/groups.py: position p
    in entry (p // block_size) % n, read before a step overwrites it); every path would index
    the ring's table by p // block_size as full attention does and read past its n entries or
    the wrong slots. So a model config with a ring group is refused at start-up rather than
    run wrongly."""
    rings = [g for g in kv_groups if g.kind == "ring"]
    if rings:
        layers = sorted(i for g in rings for i in g.layer_indices)
        raise UnsupportedModelError(
            f"ring-buffer KV cache groups (layers {layers}, ring sizes "
            f"{sorted({g.ring_size for g in rings})}) are not supported by this worker's "
            "attention"
        )


def resolve_backend(
    device: torch.device | str,
    kv_groups: list[KVGroupSpec],
    kv_dtype: torch.dtype,
    *,
    non_causal: bool = False,
) -> AttentionBackend:
    """The backend of this configuration, or BackendCapabilityError (fail closed); a ring
    group is refused (UnsupportedModelError) before any backend is asked."""
    refuse_ring_groups(kv_groups)
    needs = attention_requirements(kv_groups, kv_dtype, non_causal)
    return select_backend(backend_name(device, kv_groups), needs)
