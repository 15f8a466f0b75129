"""The GEMV whose split-K partials are summed by the next RMSNorm's kernel (the decode chain's
o and down projections) against the same product reduced on its own and then normed."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.decode_chain.gemv import GemvConfig, gemv, gemv_add_rmsnorm
from meshllm_kernels.layers.rmsnorm import rmsnorm, rmsnorm_reference

CONFIGS = (
    None,
    GemvConfig(block_n=32, block_k=64, split_k=1),
    GemvConfig(block_n=32, block_k=64, split_k=3),
)


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gated", [False, True])
def test_equals_product_then_residual_norm(device, rows, dtype, gated) -> None:  # type: ignore[no-untyped-def]
    """Bit for bit the unfused pair: gemv (its own reduce) then rmsnorm with the residual."""
    hidden, k = 200, 328  # neither a multiple of the tiles: masked edges
    x = torch.randn(rows, 2 * k if gated else k, device=device).to(dtype)
    weight = (torch.randn(hidden, k, device=device) * k**-0.5).to(dtype)
    residual = torch.randn(rows, hidden, device=device).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    for config in CONFIGS:
        normed, stream = gemv_add_rmsnorm(
            x, weight, residual, norm_weight, 1e-5, config, gated=gated
        )
        product = gemv(x, weight, config, gated=gated)
        ref_normed, ref_stream = rmsnorm(product, norm_weight, 1e-5, residual)
        assert normed.shape == stream.shape == (rows, hidden)
        assert normed.dtype == stream.dtype == dtype
        assert torch.equal(stream, ref_stream), config
        assert torch.equal(normed, ref_normed), config
    # And it is the transformers-order norm of residual + product (not of either alone).
    ref, _ = rmsnorm_reference(product, norm_weight, 1e-5, residual)
    torch.testing.assert_close(normed.float(), ref.float(), rtol=4 * 2**-7, atol=1e-5)
    assert not torch.allclose(normed, rmsnorm(product, norm_weight, 1e-5)[0])


def test_inputs_are_left_alone(device) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(2, 64, device=device)
    weight = torch.randn(48, 64, device=device)
    residual = torch.randn(2, 48, device=device)
    before = residual.clone()
    _, stream = gemv_add_rmsnorm(x, weight, residual, torch.ones(48, device=device), 1e-6)
    assert torch.equal(residual, before) and not torch.equal(stream, residual)


@pytest.mark.parametrize(
    ("message", "residual_shape", "norm_shape", "eps"),
    [
        (r"residual has shape \(2, 40\); expected \(2, 48\)", (2, 40), (48,), 1e-6),
        (r"weight has shape \(40,\); expected \(48,\)", (2, 48), (40,), 1e-6),
        ("eps must be positive", (2, 48), (48,), 0.0),
    ],
)
def test_input_errors(message, residual_shape, norm_shape, eps) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    residual = torch.randn(*residual_shape, dtype=torch.bfloat16)
    norm_weight = torch.ones(*norm_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        gemv_add_rmsnorm(x, weight, residual, norm_weight, eps)


def test_residual_dtype_must_match() -> None:
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    weight = torch.randn(48, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"residual has dtype torch\.float32"):
        gemv_add_rmsnorm(x, weight, torch.randn(2, 48), torch.ones(48, dtype=x.dtype), 1e-6)
