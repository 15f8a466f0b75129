"""The SiLU-and-multiply kernel at Llama-3-8B sizes on the GPU: bit-identical to eager
`F.silu(gate) * up` for a decode batch of 256 and an 8192-token prefill step, and the worker's
gated MLP taking it above the GEMV's 16 rows with the same output as before."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.layers.silu_mul import silu_mul, silu_mul_reference
from services.worker.accel.cuda_layers import TRITON, GemvGatedMLP

INTERMEDIATE = 14336


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [17, 256, 8192])
def test_bit_identical_to_eager(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    x = (2 * torch.randn(rows, 2 * INTERMEDIATE, device="cuda")).to(dtype)
    assert torch.equal(silu_mul(x), silu_mul_reference(x))


def test_gated_mlp_above_gemv_rows() -> None:
    torch.manual_seed(0)
    mlp = TRITON.gated_mlp(512, 1408).to("cuda", torch.bfloat16)
    assert isinstance(mlp, GemvGatedMLP)
    for p in mlp.parameters():
        p.data.normal_(0.0, 0.05)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        gate_up = mlp.gate_up_proj(x)  # 64 rows: past the GEMV, cuBLAS
        expected = mlp.down_proj(silu_mul_reference(gate_up))
        out = mlp(x)
    assert torch.equal(out, expected)
