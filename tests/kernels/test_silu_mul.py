"""The gated MLP's SiLU-and-multiply kernel against eager `F.silu(gate) * up`."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.layers.silu_mul import BLOCK, silu_mul, silu_mul_reference
from meshllm_kernels.runtime.tensor_checks import interpreting

ULP = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-23}


def _assert_matches_eager(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-identical on a GPU (libdevice expf, IEEE division, eager's two roundings). The
    interpreter's exp is numpy's (last fp32 place) and its fp32 -> bf16 cast truncates, so
    there each value may be a few ulps off."""
    if not interpreting():
        assert torch.equal(out, ref)
        return
    ulps = 4 if out.dtype == torch.bfloat16 else 2
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * ULP[out.dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "width"), [(1, 64), (5, 1000), (3, BLOCK + 7)])
def test_matches_eager(device, dtype, rows, width) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(rows * width)
    x = (3 * torch.randn(rows, 2 * width, device=device)).to(dtype)
    out = silu_mul(x)
    assert out.shape == (rows, width) and out.dtype == dtype
    _assert_matches_eager(out, silu_mul_reference(x))


def test_gate_and_up_are_not_interchangeable(device) -> None:  # type: ignore[no-untyped-def]
    # silu applies to the first half only: swapping the halves changes the result.
    x = torch.randn(4, 2 * 96, device=device)
    swapped = torch.cat([x[:, 96:], x[:, :96]], dim=1)
    assert not torch.allclose(silu_mul(x), silu_mul(swapped))
    _assert_matches_eager(silu_mul(swapped), silu_mul_reference(swapped))


def test_strided_rows(device) -> None:  # type: ignore[no-untyped-def]
    # A [T, 2D] view into a wider buffer (row stride > 2D), as a slice of a fused projection.
    wide = torch.randn(6, 2 * 80 + 24, device=device, dtype=torch.bfloat16)
    x = wide[:, : 2 * 80]
    assert not x.is_contiguous()
    _assert_matches_eager(silu_mul(x), silu_mul_reference(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, in the interpreter
def test_extreme_values(device) -> None:  # type: ignore[no-untyped-def]
    # exp(-x) overflows for very negative x (silu -> -0.0) and vanishes for large x (silu ->
    # x); infinities and NaN propagate as in eager.
    gate = torch.tensor([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, float("inf")]])
    up = torch.tensor([[2.0, 3.0, -1.5, 7.0, 0.5, -2.0, 1.0, 1.0]])
    x = torch.cat([gate, up], dim=1).to(device)
    out, ref = silu_mul(x), silu_mul_reference(x)
    torch.testing.assert_close(out, ref, equal_nan=True)
    nan = torch.cat([torch.tensor([[float("nan")]]), torch.tensor([[1.0]])], dim=1)
    assert torch.isnan(silu_mul(nan.to(device))).all()


def test_empty_batch(device) -> None:  # type: ignore[no-untyped-def]
    out = silu_mul(torch.empty(0, 128, device=device))
    assert out.shape == (0, 64)


def test_input_errors(device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="even width"):
        silu_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="2 dimensions"):
        silu_mul(torch.randn(8, device=device))
    with pytest.raises(TypeError, match=r"dtype torch\.int64"):
        silu_mul(torch.ones(2, 8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        silu_mul(torch.randn(8, 2, device=device).t())
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        silu_mul([[1.0, 2.0]])  # type: ignore[arg-type]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA"):
        silu_mul(torch.randn(2, 8))
