"""The write path of context-only KV: K/V that is already in cache form, written at slots.

KV loaded from the offload tier (Redis), which is also how prefill/decode disaggregation hands
a prefill's KV to the decode side, was computed by some forward and copied out of a paged cache
as it lay there: K already rotated, values already in the cache's dtype. Writing it back is the
KV-only variant of the forward's fused insert (CONTRACTS: "KV insertion: a KV-only variant"),
with no rotation (positions and RoPE table None), so a loaded block goes through the same
addressing code (the cache tensor's own strides, int64 slots) as a block the forward wrote. On
CPU the reference path's `write_kv` does the same write.

Invariant: the write is lossless. The kernel converts through fp32 in registers, exact for the
16/32-bit cache dtypes; an fp8 cache is refused by the kernel's input checks (it quantizes
model-dtype K/V with scales, and loaded K/V is already fp8). The worker never allocates an fp8
cache (runner/kv_cache.py holds the model's dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.attention.reference import write_kv

#: (kv_cache, key, value, slot_mapping): key/value [T, kv_heads, head_dim] in cache form,
#: slot_mapping [T] int64 on the cache's device.
ContextKVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def kernel_insert(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The KV-only insert kernel, without rotation (Triton: CUDA, or its interpreter)."""
    from meshllm_kernels.attention.kv_insert import insert_kv

    insert_kv(key, value, kv_cache, slot_mapping, None, None)


def context_kv_writer(device: torch.device | str) -> ContextKVWriter:
    """The writer for caches on `device`: the kernel on CUDA, `write_kv` on CPU."""
    return kernel_insert if torch.device(device).type == "cuda" else write_kv
