"""Attention backends and their declared capabilities (CONTRACTS: "Non-causal draft blocks").

A backend declares what it can compute; the worker asks `select_backend` once per configuration
(services/worker/attention/backend_choice.py: at start-up, for what its steps need) and gets an
error rather than a backend that would silently compute something else. Non-causal query blocks
are the case in point: a kernel that ignores the flag still returns plausible numbers (each
draft query sees one key fewer), so the capability must be declared and checked, never assumed
(fail closed).

Two kinds of backend: `PagedKernelBackend`s expose paged prefill/decode kernels that the CUDA
path calls (`prefill`, `decode`: the kernel functions themselves, bound once per instance, so a
layer's call costs no forwarding frame); the CPU reference path
(services/worker/attention/reference.py) registers a capability-only backend, since it runs its
own flat-batch attention. Kernel modules are imported when a backend is instantiated, never at
import: a CPU worker has no Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch


class BackendCapabilityError(RuntimeError):
    """No registered backend can compute what the batch needs."""


@dataclass(frozen=True)
class AttentionRequirements:
    """What the micro-batches of one configuration need from their attention backend."""

    non_causal: bool = False
    sliding_window: bool = False
    fp8_kv: bool = False


class AttentionBackend:
    name: ClassVar[str]
    supports_non_causal: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_fp8_kv: ClassVar[bool] = False

    @classmethod
    def missing(cls, needs: AttentionRequirements) -> list[str]:
        """The capabilities `needs` asks for that this backend lacks (empty: it can serve)."""
        lacks = []
        if needs.non_causal and not cls.supports_non_causal:
            lacks.append("non_causal")
        if needs.sliding_window and not cls.supports_sliding_window:
            lacks.append("sliding_window")
        if needs.fp8_kv and not cls.supports_fp8_kv:
            lacks.append("fp8_kv")
        return lacks


class PagedKernelBackend(AttentionBackend):
    """A backend of paged kernels with the signatures of meshllm_kernels.attention.paged_prefill /
    paged_decode: `prefill(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, *, causal,
    sliding_window, sm_scale, k_scale, v_scale, max_seqlen_q, out)` and `decode(q, kv_cache,
    block_tables, seq_lens, *, sliding_window, sm_scale, k_scale, v_scale, num_splits,
    max_seq_len, out)`."""

    prefill: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"attention backend {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def select_backend(
    name: str,
    needs: AttentionRequirements,
    registry: Mapping[str, type[AttentionBackend]] | None = None,
) -> AttentionBackend:
    """An instance of backend `name`, or BackendCapabilityError if it cannot serve `needs`."""
    backends = _REGISTRY if registry is None else registry
    cls = backends.get(name)
    if cls is None:
        raise BackendCapabilityError(
            f"unknown attention backend {name!r}; registered: {sorted(backends)}"
        )
    lacks = cls.missing(needs)
    if lacks:
        raise BackendCapabilityError(
            f"attention backend {name!r} does not support {', '.join(lacks)}"
        )
    return cls()


@register_backend
class TritonPagedAttention(PagedKernelBackend):
    """The Triton kernels of meshllm_kernels.attention.paged_prefill /
    meshllm_kernels.attention.paged_decode
    (GPU; CPU tensors under TRITON_INTERPRET)."""

    name = "triton"
    supports_non_causal = True
    supports_sliding_window = True
    supports_fp8_kv = True

    def __init__(self) -> None:
        from meshllm_kernels.attention.paged_decode import paged_decode_attention
        from meshllm_kernels.attention.paged_prefill import paged_prefill_attention

        self.prefill = paged_prefill_attention
        self.decode = paged_decode_attention
