"""The GEMV that does the RMSNorm of its input itself (kernels/gemv_norm_in.py) against an
fp32 reference, and its stream against the norm kernel's rounding."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import GemvConfig, gemv_add_rmsnorm, gemv_partials
from kernels.gemv_norm_in import gemv_rmsnorm_in, gemv_rmsnorm_in_reference
from kernels.rmsnorm import rmsnorm

HIDDEN, N = 328, 200  # neither a multiple of the tiles: masked edges on K and N
CONFIGS = (None, GemvConfig(block_n=32, block_k=64, split_k=1))


def _inputs(device, rows, split, dtype):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device).manual_seed(rows * 10 + split)
    partials = torch.randn(split, rows, HIDDEN, device=device, generator=gen)
    residual = torch.randn(rows, HIDDEN, device=device, generator=gen).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(HIDDEN, device=device, generator=gen)).to(dtype)
    weight = (torch.randn(N, HIDDEN, device=device, generator=gen) * HIDDEN**-0.5).to(dtype)
    return partials, residual, norm_weight, weight


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_fp32_reference(device, rows, split, dtype) -> None:  # type: ignore[no-untyped-def]
    partials, residual, norm_weight, weight = _inputs(device, rows, split, dtype)
    ref, ref_stream = gemv_rmsnorm_in_reference(partials, residual, norm_weight, 1e-5, weight)
    for config in CONFIGS:
        out, stream = gemv_rmsnorm_in(partials, residual, norm_weight, 1e-5, weight, config)
        assert out.shape == (rows, N) and out.dtype == dtype
        assert stream.shape == (rows, HIDDEN) and stream.dtype == dtype
        assert _relative_error(out, ref) < (8e-3 if dtype == torch.bfloat16 else 1e-5), config
        # (the interpreter rounds to bf16 by truncation, the GPU to nearest: twice an ulp or two)
        torch.testing.assert_close(stream.float(), ref_stream.float(), rtol=2**-6, atol=2**-6)
    # The norm is applied: without it (or without the residual) the product is another one.
    bare = (partials.sum(0) + residual.float()) @ weight.float().t()
    assert _relative_error(bare, ref) > 0.1


def test_even_shapes_take_the_unmasked_loads(device) -> None:  # type: ignore[no-untyped-def]
    """K and N multiples of the tiles (the model's shapes): the loads without K masks."""
    gen = torch.Generator(device).manual_seed(4)
    partials = torch.randn(2, 3, 256, device=device, generator=gen)
    residual = torch.randn(3, 256, device=device, generator=gen).to(torch.bfloat16)
    norm_weight = (1 + 0.3 * torch.randn(256, device=device, generator=gen)).to(torch.bfloat16)
    weight = (torch.randn(192, 256, device=device, generator=gen) / 16).to(torch.bfloat16)
    ref, ref_stream = gemv_rmsnorm_in_reference(partials, residual, norm_weight, 1e-5, weight)
    out, stream = gemv_rmsnorm_in(
        partials, residual, norm_weight, 1e-5, weight, GemvConfig(64, 64, 1)
    )
    assert _relative_error(out, ref) < 8e-3
    torch.testing.assert_close(stream.float(), ref_stream.float(), rtol=2**-6, atol=2**-6)


def test_stream_and_product_agree_with_the_unfused_chain(device) -> None:  # type: ignore[no-untyped-def]
    """The stream is the norm kernel's bit for bit; the product is the GEMV of that kernel's
    normed output up to the rounding of the normed input (applied before vs after)."""
    rows, dtype = 2, torch.bfloat16
    gen = torch.Generator(device).manual_seed(3)
    x = torch.randn(rows, 256, device=device, generator=gen).to(dtype)
    o_weight = (torch.randn(HIDDEN, 256, device=device, generator=gen) / 16).to(dtype)
    _, residual, norm_weight, weight = _inputs(device, rows, 1, dtype)
    split = GemvConfig(block_n=32, block_k=64, split_k=2)
    normed, ref_stream = gemv_add_rmsnorm(x, o_weight, residual, norm_weight, 1e-5, split)
    partials = gemv_partials(x, o_weight, split)
    out, stream = gemv_rmsnorm_in(partials, residual, norm_weight, 1e-5, weight)
    assert torch.equal(stream, ref_stream)
    unfused = (normed.float() @ weight.float().t()).to(dtype)
    torch.testing.assert_close(out.float(), unfused.float(), rtol=2e-2, atol=2e-2)
    # And the same norm as the norm kernel alone applies to that stream.
    torch.testing.assert_close(normed, rmsnorm(ref_stream, norm_weight, 1e-5)[0])


def test_fp32_out_is_split_one_partials(device) -> None:  # type: ignore[no-untyped-def]
    partials, residual, norm_weight, weight = _inputs(device, 2, 2, torch.bfloat16)
    out, _ = gemv_rmsnorm_in(partials, residual, norm_weight, 1e-5, weight, fp32_out=True)
    assert out.shape == (1, 2, N) and out.dtype == torch.float32
    rounded, _ = gemv_rmsnorm_in(partials, residual, norm_weight, 1e-5, weight)
    # the same product, rounded by the kernel (to nearest on a GPU, truncated in the interpreter)
    torch.testing.assert_close(out[0], rounded.float(), rtol=2**-7, atol=1e-6)


def test_inputs_are_left_alone(device) -> None:  # type: ignore[no-untyped-def]
    partials, residual, norm_weight, weight = _inputs(device, 2, 2, torch.float32)
    before = (partials.clone(), residual.clone())
    gemv_rmsnorm_in(partials, residual, norm_weight, 1e-5, weight)
    assert torch.equal(partials, before[0]) and torch.equal(residual, before[1])


@pytest.mark.parametrize(
    ("message", "change"),
    [
        ("needs split_k 1", {"config": GemvConfig(block_n=32, block_k=64, split_k=2)}),
        (r"weight is \[N, K\] = \(200, 320\) but the partials have K = 328", {"k": 320}),
        ("gemv takes 1..16 rows, got 17", {"rows": 17}),
        ("partials has dtype torch.bfloat16", {"partials_dtype": torch.bfloat16}),
        (r"residual has shape \(2, 300\); expected \(2, 328\)", {"residual_k": 300}),
        ("eps must be positive", {"eps": 0.0}),
    ],
)
def test_bad_inputs_get_clear_errors(device, message, change) -> None:  # type: ignore[no-untyped-def]
    rows = change.get("rows", 2)
    partials, residual, norm_weight, weight = _inputs(device, rows, 1, torch.float32)
    if "k" in change:
        weight = weight[:, : change["k"]].contiguous()
    if "partials_dtype" in change:
        partials = partials.to(change["partials_dtype"])
    if "residual_k" in change:
        residual = residual[:, : change["residual_k"]].contiguous()
    with pytest.raises((ValueError, TypeError), match=message):
        gemv_rmsnorm_in(
            partials, residual, norm_weight, change.get("eps", 1e-5), weight,
            change.get("config"),
        )  # fmt: skip
