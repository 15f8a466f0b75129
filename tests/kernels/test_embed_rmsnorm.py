"""The decode chain's first kernel (meshllm_kernels/decode_chain/embed_rmsnorm.py): fed ids,
embedding,
RMSNorm."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.decode_chain.embed_rmsnorm import embed_rmsnorm
from meshllm_kernels.decode_chain.token_feed import feed_token_ids_reference
from meshllm_kernels.layers.rmsnorm import rmsnorm
from services.worker.runner.in_flight import fed_id


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_feed_the_embedding_and_the_norm_apart(
    device: torch.device, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(5)
    vocab, hidden = 50, 96  # hidden no power of two: a masked tail
    table = torch.randn(vocab, hidden, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    latest = torch.tensor([7, 49, 3], device=device)
    ids = torch.tensor([4, fed_id(1), 0, fed_id(2), fed_id(1)], device=device)
    normed, stream = embed_rmsnorm(ids, table, weight, 1e-5, latest=latest)
    resolved = feed_token_ids_reference(ids, latest)
    assert resolved.tolist() == [4, 49, 0, 3, 49]
    want_stream = table[resolved]
    want_normed, _ = rmsnorm(want_stream, weight, 1e-5)
    assert torch.equal(stream, want_stream)
    assert torch.equal(normed, want_normed)  # bit for bit the separate launches


def test_without_a_feed_ids_are_plain_tokens(device: torch.device) -> None:
    table = torch.randn(10, 32).to(device)
    weight = torch.ones(32, device=device)
    ids = torch.tensor([9, 0, 9], device=device)
    normed, stream = embed_rmsnorm(ids, table, weight, 1e-6)
    assert torch.equal(stream, table[ids])
    assert torch.equal(normed, rmsnorm(table[ids], weight, 1e-6)[0])


def test_bad_inputs_are_named(device: torch.device) -> None:
    table = torch.randn(10, 32, device=device)
    weight = torch.ones(32, device=device)
    ids = torch.tensor([1, 2], device=device)
    with pytest.raises(TypeError, match="ids"):
        embed_rmsnorm(ids.int(), table, weight, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        embed_rmsnorm(ids, table, torch.ones(16, device=device), 1e-6)
    with pytest.raises(TypeError, match="weight"):
        embed_rmsnorm(ids, table, weight.double(), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        embed_rmsnorm(ids, table, weight, 0.0)
    with pytest.raises(TypeError, match="latest"):
        embed_rmsnorm(ids, table, weight, 1e-6, latest=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="latest"):
        embed_rmsnorm(ids, table, weight, 1e-6, latest=torch.zeros(6, device=device).long()[::2])
