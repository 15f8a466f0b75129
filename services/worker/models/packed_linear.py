"""bf16 linear layers on CPU with oneDNN weights packed once at load time.

`F.linear` on bf16 CPU tensors reorders the weight into oneDNN's blocked layout on every call;
packing once (`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise` skips
that, which is faster for decode batches and prefill chunks alike (SmolLM2 shapes on the dev
machine); outputs equal `F.linear` to the last bf16 bit in nearly every element. These are
private PyTorch ops (the ones inductor's CPU freezing uses), so packing is probed first and
skipped, keeping plain `nn.Linear`, wherever they are missing or disagree.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """y = x W^T + b with W held only in oneDNN's packed layout (2-D inputs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where packed bf16 linears exist and agree with F.linear on a probe."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 64, generator=generator).to(dtype)
        x = torch.randn(3, 64, generator=generator).to(dtype)
        with torch.inference_mode():
            packed = PackedLinear(weight, None)(x)
        return bool(torch.allclose(packed.float(), F.linear(x, weight).float(), atol=0.1))
    except (RuntimeError, AttributeError) as exc:  # op missing from this torch build
        log.info("packed bf16 linears unavailable: %s", exc)
        return False


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a PackedLinear; returns how many.

    The checkpoint-layout weights are dropped (packing keeps one copy of the weights).
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
