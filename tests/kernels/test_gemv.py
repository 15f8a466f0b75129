"""Decode GEMV / skinny GEMM against an fp32 product."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.decode_chain.gemv import GemvConfig, gemv, gemv_reference, heuristic_config


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("batch", [1, 3, 16, 17, 40, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp32_product(device, batch, dtype) -> None:  # type: ignore[no-untyped-def]
    # N and K deliberately not multiples of the tiles: masked edges on both.
    x = torch.randn(batch, 328, device=device).to(dtype)
    weight = torch.randn(200, 328, device=device).to(dtype)
    ref = (x.double() @ weight.double().t()).float()
    for config in (None, GemvConfig(block_n=64, block_k=64, split_k=1),
                   GemvConfig(block_n=32, block_k=64, split_k=3)):  # fmt: skip
        out = gemv(x, weight, config)
        assert out.shape == (batch, 200) and out.dtype == dtype
        assert _relative_error(out, ref) < (8e-3 if dtype == torch.bfloat16 else 1e-3), config
        torch.testing.assert_close(out, gemv_reference(x, weight), rtol=2e-2, atol=2e-2)


def test_rows_past_the_tuned_batch_pad_to_a_power_of_two_within_shared_memory() -> None:
    """Up to 16 rows the tuned launch; past it BLOCK_M is the next power of two, the warps
    grow with the accumulator and the stages shrink until both tiles fit the budget."""
    from meshllm_kernels.decode_chain.gemv import SMEM_BUDGET, _rows_launch

    cfg = GemvConfig(block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=4)
    assert _rows_launch(1, cfg, 2) == _rows_launch(16, cfg, 2) == (16, 4, 4)
    assert _rows_launch(17, cfg, 2)[0] == 32 and _rows_launch(64, cfg, 2)[0] == 64
    for m in (17, 33, 64, 100, 128):
        block_m, warps, stages = _rows_launch(m, cfg, 2)
        assert block_m >= m and warps >= 4 and stages >= 1
        assert (128 + block_m) * 128 * 2 * stages <= SMEM_BUDGET
    assert _rows_launch(128, cfg, 2) == (128, 8, 3)
    # gated: x's up half is a second tile per stage (96 rows: 294,912 bytes at 3 stages, past
    # the H100's 232,448, was a launch failure on the GPU)
    for m in (17, 64, 96, 128):
        block_m, _, stages = _rows_launch(m, cfg, 2, gated=True)
        assert (128 + 2 * block_m) * 128 * 2 * stages <= SMEM_BUDGET
    assert _rows_launch(96, cfg, 2, gated=True)[2] == 2


def test_split_k_is_deterministic_and_agrees_with_one_pass(device) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(4, 512, device=device, dtype=torch.bfloat16)
    weight = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    split = GemvConfig(block_n=32, block_k=64, split_k=4)
    first = gemv(x, weight, split)
    assert torch.equal(first, gemv(x, weight, split))
    one_pass = gemv(x, weight, GemvConfig(block_n=32, block_k=64, split_k=1))
    torch.testing.assert_close(first.float(), one_pass.float(), rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_equals_silu_times_up_then_product(device, dtype) -> None:  # type: ignore[no-untyped-def]
    """The down projection with its activation fused into the loads of x: the same as the
    eager MLP's F.silu(gate) * up (rounded in x's dtype) times weight^T, split-K included."""
    intermediate = 200  # not a multiple of the K tile: masked edges
    gate_up = (2 * torch.randn(5, 2 * intermediate, device=device)).to(dtype)
    weight = torch.randn(96, intermediate, device=device).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    eager_input = torch.nn.functional.silu(gate) * up
    for config in (None, GemvConfig(block_n=32, block_k=64, split_k=3)):
        out = gemv(gate_up, weight, config, gated=True)
        plain = gemv(eager_input.contiguous(), weight, config)
        assert out.shape == (5, 96) and out.dtype == dtype
        ref = gemv_reference(gate_up, weight, gated=True)
        if dtype == torch.float32:  # same inputs, same reduction order as the unfused call
            torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
        else:  # bf16: the activation's rounding may differ by an ulp (the interpreter
            # truncates where the GPU rounds to nearest: 0.8% / 1.0% measured there)
            assert _relative_error(out, plain) < 2e-2
            assert _relative_error(out, ref) < 2e-2
    # The activation matters: without it the product is another one.
    assert not torch.allclose(out.float(), gemv(up.contiguous(), weight).float(), atol=1e-1)


def test_gated_input_errors() -> None:
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even width"):
        gemv(torch.randn(2, 33, dtype=torch.bfloat16), weight, gated=True)
    with pytest.raises(ValueError, match=r"half of x \(gate \| up\) has K = 12"):
        gemv(torch.randn(2, 24, dtype=torch.bfloat16), weight, gated=True)


def test_heuristic_reproduces_the_h200_sweep() -> None:
    """On 132 SMs the heuristic picks the split factors the H200 sweep found best."""
    from meshllm_kernels.decode_chain.gemv import H200_CONFIGS

    for (n, k), tuned in H200_CONFIGS.items():
        assert heuristic_config(n, k, 132).split_k == tuned.split_k, (n, k)
    # Never below 4 K-steps (of 128) per split.
    assert heuristic_config(64, 1024, 132).split_k == 2
    assert heuristic_config(64, 512, 132).split_k == 1


@pytest.mark.parametrize(
    ("exc", "message", "x_shape", "w_shape", "w_dtype"),
    [
        (ValueError, r"1\.\.128 rows, got 129", (129, 64), (32, 64), torch.bfloat16),
        (ValueError, "x has K = 64", (2, 64), (32, 48), torch.bfloat16),
        (TypeError, "weight has dtype torch.float16", (2, 64), (32, 64), torch.float16),
        (ValueError, "weight must have 2 dimensions", (2, 64), (32, 64, 1), torch.bfloat16),
    ],
)
def test_input_errors(exc, message, x_shape, w_shape, w_dtype) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(*x_shape, dtype=torch.bfloat16)
    weight = torch.randn(*w_shape).to(w_dtype)
    with pytest.raises(exc, match=message):
        gemv(x, weight)


def test_rejects_integer_inputs() -> None:
    with pytest.raises(TypeError, match=r"x has dtype torch\.int32"):
        gemv(torch.ones(1, 8, dtype=torch.int32), torch.ones(8, 8, dtype=torch.int32))
