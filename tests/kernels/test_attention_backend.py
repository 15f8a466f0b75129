"""Attention backends declare capabilities; selection fails closed."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.backends import (
    AttentionBackend,
    AttentionRequirements,
    BackendCapabilityError,
    TorchPagedAttention,
    registered_backends,
    select_backend,
)
from tests.kernels.paged_batch import make_paged_batch


class CausalOnly(TorchPagedAttention):
    """A backend that cannot do non-causal blocks (like a FlashAttention build without it)."""

    name = "causal_only"
    supports_non_causal = False


def test_triton_and_torch_backends_support_non_causal_blocks() -> None:
    needs = AttentionRequirements(non_causal=True, sliding_window=True, fp8_kv=True)
    for name in ("triton", "torch"):
        assert isinstance(select_backend(name, needs), AttentionBackend)
        assert registered_backends()[name].supports_non_causal


def test_backend_without_the_capability_is_refused() -> None:
    registry = {**registered_backends(), CausalOnly.name: CausalOnly}
    with pytest.raises(BackendCapabilityError, match="'causal_only' does not support non_causal"):
        select_backend("causal_only", AttentionRequirements(non_causal=True), registry)
    # The same backend serves a causal batch.
    assert isinstance(select_backend("causal_only", AttentionRequirements(), registry), CausalOnly)


def test_unknown_backend() -> None:
    with pytest.raises(BackendCapabilityError, match="unknown attention backend 'flash'"):
        select_backend("flash", AttentionRequirements())


def test_backends_agree(device) -> None:  # type: ignore[no-untyped-def]
    batch = make_paged_batch(
        [10, 17], [2, 17], num_heads=4, num_kv_heads=2, head_dim=16, page=4,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    needs = AttentionRequirements(non_causal=True)
    args = (batch.q, batch.kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens)
    outs = [select_backend(n, needs).prefill(*args, causal=False) for n in ("triton", "torch")]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    dq = batch.q[:2]
    dargs = (dq, batch.kv_cache, batch.block_tables, batch.seq_lens)
    outs = [select_backend(n, needs).decode(*dargs, sliding_window=5) for n in ("triton", "torch")]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
