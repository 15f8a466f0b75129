"""Attention backends declare capabilities; selection fails closed; a paged kernel backend's
entry points are the kernels themselves."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention.backends import (
    AttentionRequirements,
    BackendCapabilityError,
    TritonPagedAttention,
    select_backend,
)
from meshllm_kernels.attention.paged_decode import paged_decode_attention, paged_decode_reference
from meshllm_kernels.attention.paged_prefill import paged_prefill_attention, paged_prefill_reference
from tests.kernels.paged_batch import make_paged_batch


class CausalOnly(TritonPagedAttention):
    """A backend that cannot do non-causal blocks (like a FlashAttention build without it)."""

    name = "causal_only"
    supports_non_causal = False


def test_triton_backend_supports_every_requirement() -> None:
    needs = AttentionRequirements(non_causal=True, sliding_window=True, fp8_kv=True)
    backend = select_backend("triton", needs)
    assert isinstance(backend, TritonPagedAttention)
    # The entry points are the kernels: a layer's call costs no forwarding frame.
    assert backend.prefill is paged_prefill_attention
    assert backend.decode is paged_decode_attention


def test_backend_without_the_capability_is_refused() -> None:
    registry = {CausalOnly.name: CausalOnly}
    with pytest.raises(BackendCapabilityError, match="'causal_only' does not support non_causal"):
        select_backend("causal_only", AttentionRequirements(non_causal=True), registry)
    # The same backend serves a causal batch.
    assert isinstance(select_backend("causal_only", AttentionRequirements(), registry), CausalOnly)


def test_unknown_backend() -> None:
    with pytest.raises(BackendCapabilityError, match="unknown attention backend 'flash'"):
        select_backend("flash", AttentionRequirements())


def test_triton_backend_matches_the_references(device) -> None:  # type: ignore[no-untyped-def]
    """Non-causal prefill (qlen 2 over 10: row 0 sees all 10 keys) and a windowed decode."""
    batch = make_paged_batch(
        [10, 17], [2, 17], num_heads=4, num_kv_heads=2, head_dim=16, page=4,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    backend = select_backend("triton", AttentionRequirements(non_causal=True, sliding_window=True))
    args = (batch.q, batch.kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens)
    out = backend.prefill(*args, causal=False)  # type: ignore[attr-defined]
    torch.testing.assert_close(out, paged_prefill_reference(*args, causal=False), atol=1e-5, rtol=0)
    causal = paged_prefill_reference(*args, causal=True)
    assert not torch.allclose(out[:1], causal[:1], atol=1e-3)  # the flag is not ignored
    dargs = (batch.q[:2], batch.kv_cache, batch.block_tables, batch.seq_lens)
    out = backend.decode(*dargs, sliding_window=5)  # type: ignore[attr-defined]
    torch.testing.assert_close(
        out, paged_decode_reference(*dargs, sliding_window=5), atol=1e-5, rtol=0
    )
