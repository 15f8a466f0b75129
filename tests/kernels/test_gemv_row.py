"""The one-row GEMV on CUDA cores (kernels/gemv_row.py) against an fp32 product, and where the
GEMV launcher chooses it."""

from __future__ import annotations

import pytest
import torch

from kernels import gemv_row
from kernels.gemv import GemvConfig, _checked, gemv, gemv_add_rmsnorm, gemv_partials
from kernels.rmsnorm import rmsnorm


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


CORES = (
    GemvConfig(block_n=8, block_k=64, split_k=1, cores=True),
    GemvConfig(block_n=32, block_k=64, split_k=3, num_warps=8, cores=True),
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_fp32_product(device, dtype) -> None:  # type: ignore[no-untyped-def]
    # N and K not multiples of the tiles: masked edges on both.
    x = torch.randn(1, 328, device=device).to(dtype)
    weight = torch.randn(200, 328, device=device).to(dtype)
    ref = (x.double() @ weight.double().t()).float()
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    for config in CORES:
        out = gemv(x, weight, config)
        assert out.shape == (1, 200) and out.dtype == dtype
        assert _relative_error(out, ref) < tol, config
        tensor_cores = gemv(x, weight, GemvConfig(block_n=32, block_k=64, split_k=config.split_k))
        assert _relative_error(out, tensor_cores) < tol, config


def test_partials_sum_to_the_product_and_repeat_exactly(device) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(1, 512, device=device, dtype=torch.bfloat16)
    weight = torch.randn(96, 512, device=device, dtype=torch.bfloat16)
    config = GemvConfig(block_n=16, block_k=64, split_k=4, cores=True)
    part = gemv_partials(x, weight, config)
    assert part.shape == (4, 1, 96) and part.dtype == torch.float32
    ref = x.double() @ weight.double().t()
    assert _relative_error(part.sum(0), ref) < 1e-5
    # Each split covers its own quarter of K.
    quarter = x[:, 128:256].double() @ weight[:, 128:256].double().t()
    assert _relative_error(part[1], quarter) < 1e-5
    assert torch.equal(part, gemv_partials(x, weight, config))


def test_partials_feed_the_residual_norm(device) -> None:  # type: ignore[no-untyped-def]
    """gemv_add_rmsnorm sums the CUDA-core partials as it sums the tensor-core ones: equal to
    the product, then the residual add and RMSNorm."""
    x = torch.randn(1, 320, device=device, dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(256, 320, device=device)).to(torch.bfloat16)
    residual = torch.randn(1, 256, device=device, dtype=torch.bfloat16)
    norm_weight = torch.rand(256, device=device, dtype=torch.bfloat16) + 0.5
    config = GemvConfig(block_n=16, block_k=64, split_k=2, cores=True)
    normed, stream = gemv_add_rmsnorm(x, weight, residual, norm_weight, 1e-5, config)
    product = gemv(x, weight, config)
    want_normed, want_stream = rmsnorm(product, norm_weight, 1e-5, residual)
    assert torch.equal(stream, want_stream)
    assert torch.equal(normed, want_normed)


def test_the_launcher_takes_it_for_one_plain_row_at_tuned_shapes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(gemv_row.H200_ROW_CONFIGS, (96, 128), (16, 64, 2, 4))
    weight = torch.randn(96, 128, dtype=torch.bfloat16)

    def chosen(rows: int, **kw: bool) -> GemvConfig:
        width = 256 if kw.get("gated") else 128
        x = torch.randn(rows, width, dtype=torch.bfloat16)
        return _checked(x, weight, None, kw.get("gated", False), False).config

    one = chosen(1)
    assert one.cores and (one.block_n, one.split_k) == (16, 2)
    assert not chosen(2).cores  # more rows: the tensor cores
    assert not chosen(1, gated=True).cores  # the gated down projection: the tensor cores
    monkeypatch.setattr(gemv_row, "ROW_GEMV_DEFAULT", False)
    assert not chosen(1).cores
    # An untuned shape keeps the tensor-core kernel.
    other = _checked(
        torch.randn(1, 64, dtype=torch.bfloat16),
        torch.randn(8, 64, dtype=torch.bfloat16),
        None,
        False,
        False,
    )
    assert not other.config.cores


def test_a_cores_config_takes_one_plain_row_only() -> None:
    config = GemvConfig(block_n=8, block_k=64, cores=True)
    weight = torch.randn(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one plain row, got 2"):
        gemv(torch.randn(2, 64, dtype=torch.bfloat16), weight, config)
    with pytest.raises(ValueError, match="gated=True"):
        gemv(torch.randn(1, 128, dtype=torch.bfloat16), weight, config, gated=True)
