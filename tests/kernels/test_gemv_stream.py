"""The decode chain's GEMVs around a norm (kernels/gemv.py): `gemv_into_stream` adds a
projection to the residual stream and leaves the tiles' sums of squares, `gemv_normed` applies
the RMSNorm those make up as it loads the stream."""

from __future__ import annotations

import pytest
import torch

from kernels import completion_counters
from kernels.gemv import (
    GemvConfig,
    StreamTiles,
    gemv,
    gemv_add_rmsnorm,
    gemv_into_stream,
    gemv_normed,
    gemv_partials,
)
from kernels.rmsnorm import rmsnorm

CONFIGS = (
    None,
    GemvConfig(block_n=32, block_k=64, split_k=1),
    GemvConfig(block_n=32, block_k=64, split_k=3),
)
HIDDEN, K = 200, 328  # neither a multiple of the tiles: masked edges


def _inputs(device, rows, dtype, gated):  # type: ignore[no-untyped-def]
    g = torch.Generator(device).manual_seed(rows)
    x = torch.randn(rows, 2 * K if gated else K, device=device, generator=g).to(dtype)
    weight = (torch.randn(HIDDEN, K, device=device, generator=g) * K**-0.5).to(dtype)
    residual = torch.randn(rows, HIDDEN, device=device, generator=g).to(dtype)
    return x, weight, residual


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gated", [False, True])
def test_stream_equals_the_fused_norms_stream(device, rows, dtype, gated) -> None:  # type: ignore[no-untyped-def]
    """values: bit for bit gemv_add_rmsnorm's stream (itself gemv + residual add, rounded as
    the unfused pair); tile_sq: its rows' sums of squares, BLOCK_N columns at a time."""
    x, weight, residual = _inputs(device, rows, dtype, gated)
    norm_weight = torch.ones(HIDDEN, device=device, dtype=dtype)
    for config in CONFIGS:
        state = gemv_into_stream(x, weight, residual, config, gated=gated)
        _, stream = gemv_add_rmsnorm(x, weight, residual, norm_weight, 1e-5, config, gated=gated)
        assert torch.equal(state.values, stream), config
        block_n = (config or GemvConfig()).block_n if config else None
        if block_n is not None:
            assert state.tile_sq.shape == (-(-HIDDEN // block_n), rows)
            tiles = stream.float().split(block_n, dim=1)
            want = torch.stack([(t * t).sum(1) for t in tiles])
            torch.testing.assert_close(state.tile_sq, want, rtol=1e-5, atol=1e-5)
        squares = (stream.float() ** 2).sum(1)
        torch.testing.assert_close(state.tile_sq.sum(0), squares, rtol=1e-5, atol=1e-5)
    assert completion_counters.all_zero()  # the split launches' counters reset themselves


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_normed_product_equals_norm_then_product(device, rows, dtype) -> None:  # type: ignore[no-untyped-def]
    """rmsnorm(stream) * w times W^T, rounded as the norm kernel then `gemv` (the mean square
    summed in another order: fp32's last bits)."""
    x, weight, residual = _inputs(device, rows, dtype, False)
    g = torch.Generator(device).manual_seed(9)
    norm_weight = (1 + 0.3 * torch.randn(HIDDEN, device=device, generator=g)).to(dtype)
    out_weight = (torch.randn(150, HIDDEN, device=device, generator=g) * HIDDEN**-0.5).to(dtype)
    state = gemv_into_stream(x, weight, residual, CONFIGS[2])
    normed, _ = rmsnorm(state.values, norm_weight, 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    for config in CONFIGS:
        out = gemv_normed(state, norm_weight, 1e-5, out_weight, config)
        assert out.shape == (rows, 150) and out.dtype == dtype
        torch.testing.assert_close(out, gemv(normed, out_weight, config), **tol)
        part = gemv_normed(state, norm_weight, 1e-5, out_weight, config, partials=True)
        torch.testing.assert_close(part, gemv_partials(normed, out_weight, config), **tol)
    # The norm is applied: not the product of the raw stream, nor of an unweighted norm.
    raw = gemv(state.values, out_weight)
    assert not torch.allclose(out.float(), raw.float(), rtol=0.05, atol=0.05)
    unweighted, _ = rmsnorm(state.values, torch.ones_like(norm_weight), 1e-5)
    assert not torch.allclose(out.float(), gemv(unweighted, out_weight).float(), atol=0.02)


def test_normed_input_errors(device) -> None:  # type: ignore[no-untyped-def]
    x, weight, residual = _inputs(device, 2, torch.bfloat16, False)
    state = gemv_into_stream(x, weight, residual)
    norm_weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
    out_weight = torch.randn(48, HIDDEN, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"tile_sq has shape \(\d+, 3\)"):
        bad = StreamTiles(state.values, torch.zeros(4, 3, device=device))
        gemv_normed(bad, norm_weight, 1e-5, out_weight)
    with pytest.raises(TypeError, match=r"tile_sq has dtype torch\.bfloat16"):
        gemv_normed(
            StreamTiles(state.values, state.tile_sq.bfloat16()), norm_weight, 1e-5, out_weight
        )
    with pytest.raises(ValueError, match=r"weight has shape \(40,\); expected \(200,\)"):
        gemv_normed(state, norm_weight[:40], 1e-5, out_weight)
    with pytest.raises(ValueError, match="eps must be positive"):
        gemv_normed(state, norm_weight, 0.0, out_weight)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 40\); expected \(2, 200\)"):
        gemv_into_stream(x, weight, residual[:, :40])
    with pytest.raises(TypeError, match=r"residual has dtype torch\.float32"):
        gemv_into_stream(x, weight, residual.float())
