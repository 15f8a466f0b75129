"""Attention backends and their declared capabilities (CONTRACTS: "Non-causal draft blocks").

A backend declares what it can compute; the worker asks `select_backend` for one that can do
what a micro-batch needs, and gets an error rather than a backend that would silently compute
something else. Non-causal query blocks are the case in point: a kernel that ignores the flag
still returns plausible numbers (each draft query sees one key fewer), so the capability must
be declared and checked, never assumed (fail closed).
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels.attention import paged_decode
from kernels.attention import paged_prefill as paged_attention


class BackendCapabilityError(RuntimeError):
    """No registered backend can compute what the batch needs."""


@dataclass(frozen=True)
class AttentionRequirements:
    """What one micro-batch needs from its attention backend."""

    non_causal: bool = False
    sliding_window: bool = False
    fp8_kv: bool = False


class AttentionBackend(ABC):
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

    # The backend's two entry points; both backends share the signatures below, so a backend
    # only names its functions and the forwarding is written once.
    _prefill_fn: ClassVar[Callable[..., torch.Tensor]]
    _decode_fn: ClassVar[Callable[..., torch.Tensor]]

    def prefill(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        causal: bool = True,
        sliding_window: int | None = None,
        sm_scale: float | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        return type(self)._prefill_fn(
            q, kv_cache, block_tables, cu_seqlens_q, seq_lens, causal=causal,
            sliding_window=sliding_window, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        sliding_window: int | None = None,
        sm_scale: float | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        return type(self)._decode_fn(
            q, kv_cache, block_tables, seq_lens, sliding_window=sliding_window,
            sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"attention backend {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def registered_backends() -> dict[str, type[AttentionBackend]]:
    return dict(_REGISTRY)


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
class TritonPagedAttention(AttentionBackend):
    """The Triton kernels of kernels.attention.paged_prefill / kernels.attention.paged_decode
    (GPU)."""

    name = "triton"
    supports_non_causal = True
    supports_sliding_window = True
    supports_fp8_kv = True
    _prefill_fn = staticmethod(paged_attention.paged_prefill_attention)
    _decode_fn = staticmethod(paged_decode.paged_decode_attention)


@register_backend
class TorchPagedAttention(AttentionBackend):
    """The PyTorch references (the CPU path): same semantics, one sequence at a time."""

    name = "torch"
    supports_non_causal = True
    supports_sliding_window = True
    supports_fp8_kv = True
    _prefill_fn = staticmethod(paged_attention.paged_prefill_reference)
    _decode_fn = staticmethod(paged_decode.paged_decode_reference)
