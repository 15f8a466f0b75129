"""Fused residual-add RMSNorm against the transformers-order reference."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.layers.rmsnorm import rmsnorm, rmsnorm_reference
from meshllm_kernels.runtime.tensor_checks import interpreting


def _assert_rounded_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same values up to the rounding of the last step (one ulp of the dtype).

    The fp32 mean of squares is summed in a different order than PyTorch's, so a value that
    lands on a rounding boundary may round the other way (then the weight product adds one
    more). Under the interpreter fp32->bf16 truncates instead of rounding to nearest, at each
    of the three roundings, so bf16 gets four ulps there.
    """
    ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-21}[out.dtype]
    ulps = 4 if out.dtype == torch.bfloat16 and interpreting() else 2
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * ulp, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 300])
def test_fused_residual_add(device, dtype, hidden) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(7, hidden, device=device).to(dtype)
    residual = torch.randn(7, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out, new_residual = rmsnorm(x, weight, 1e-5, residual)
    ref, ref_residual = rmsnorm_reference(x, weight, 1e-5, residual)
    assert new_residual is not None and ref_residual is not None
    if dtype == torch.bfloat16 and interpreting():
        _assert_rounded_equal(new_residual, ref_residual)
    else:
        assert torch.equal(new_residual, ref_residual)  # one rounding of x + residual
    _assert_rounded_equal(out, ref)
    # The inputs are left alone (the residual stream is returned, not written in place).
    assert not torch.equal(new_residual, residual)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_rmsnorm_on_strided_rows(device, dtype) -> None:  # type: ignore[no-untyped-def]
    wide = torch.randn(5, 256, device=device).to(dtype)
    x = wide[:, :128]  # rows 256 apart
    weight = torch.randn(128, device=device).to(dtype)
    out, residual = rmsnorm(x, weight, 1e-6)
    ref, _ = rmsnorm_reference(x, weight, 1e-6)
    assert residual is None
    _assert_rounded_equal(out, ref)


def test_empty_batch(device) -> None:  # type: ignore[no-untyped-def]
    x = torch.zeros(0, 32, device=device, dtype=torch.float16)
    out, res = rmsnorm(x, torch.ones(32, device=device, dtype=torch.float16), 1e-6, x)
    assert out.shape == (0, 32) and res is not None and res.shape == (0, 32)


@pytest.mark.parametrize(
    ("exc", "message", "call"),
    [
        (TypeError, "weight has dtype torch.float32", lambda x, w: rmsnorm(x, w.float(), 1e-6)),
        (ValueError, r"weight has shape \(31,\)", lambda x, w: rmsnorm(x, w[:31], 1e-6)),
        (ValueError, "eps must be positive", lambda x, w: rmsnorm(x, w, 0.0)),
        (ValueError, "x must have 2 dimensions", lambda x, w: rmsnorm(x[None], w, 1e-6)),
        (TypeError, "x has dtype torch.int64", lambda x, w: rmsnorm(x.long(), w, 1e-6)),
        (ValueError, r"residual has shape \(3, 32\)", lambda x, w: rmsnorm(x, w, 1e-6, x[:3])),
        (TypeError, "residual has dtype", lambda x, w: rmsnorm(x, w, 1e-6, x.float())),
        (ValueError, "contiguous last dimension", lambda x, w: rmsnorm(x.t(), w[:4], 1e-6)),
    ],
)
def test_input_errors(exc, message, call) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 32, dtype=torch.float16)
    with pytest.raises(exc, match=message):
        call(x, torch.ones(32, dtype=torch.float16))
