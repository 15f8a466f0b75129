"""RMSNorm and the gated MLP equal transformers' Llama modules; packed bf16 linears equal
F.linear."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from services.worker.models.layers import GatedMLP, RMSNorm
from services.worker.models.packed_linear import (
    PackedLinear,
    pack_linear_layers,
    packing_supported,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_fused_residual_matches_transformers(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    reference = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    reference.weight.data = torch.randn(96).to(dtype)
    ours = RMSNorm(96, eps=1e-5).to(dtype)
    ours.weight.data = reference.weight.data.clone()
    x, residual = (torch.randn(7, 96) * 3).to(dtype), torch.randn(7, 96).to(dtype)
    with torch.no_grad():
        normed, new_residual = ours(x, residual)
        expected = reference(x + residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, expected)  # bit-exact, fp32 and bf16


def test_gated_mlp_matches_transformers() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=80, mlp_bias=True)
    reference = LlamaMLP(config)
    ours = GatedMLP(32, 80, bias=True)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(
            torch.cat([reference.gate_proj.weight, reference.up_proj.weight])
        )
        ours.gate_up_proj.bias.copy_(torch.cat([reference.gate_proj.bias, reference.up_proj.bias]))
        ours.down_proj.weight.copy_(reference.down_proj.weight)
        ours.down_proj.bias.copy_(reference.down_proj.bias)
        x = torch.randn(5, 32)
        torch.testing.assert_close(ours(x), reference(x), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="this torch build has no packed bf16 oneDNN linear",
)
def test_packed_bf16_linear_equals_f_linear() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 200, bias=True).to(torch.bfloat16)
    container = torch.nn.Sequential(layer)
    assert pack_linear_layers(container) == 1
    packed = container[0]
    assert isinstance(packed, PackedLinear)
    assert "packed_weight" not in container.state_dict()  # derived, never saved or loaded
    for rows in (1, 8, 300):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        with torch.inference_mode():
            expected = torch.nn.functional.linear(x, layer.weight, layer.bias).float()
            got = packed(x).float()
        # same bf16 result up to the last bit of the largest values
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_packing_is_refused_off_cpu_bf16() -> None:
    assert not packing_supported(torch.float32, torch.device("cpu"))
    assert not packing_supported(torch.bfloat16, torch.device("meta"))
