"""RMSNorm / GEMV / split-K reduce launched as a PDL chain (tensor_checks.CHAIN_PDL_DEFAULT):
each kernel waits for its predecessor's grid before reading, so the chain computes exactly what
the plain launches compute, eagerly and inside a CUDA graph, and through the worker's layers."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_chain.gemv import GemvConfig, gemv
from kernels.layers.rmsnorm import rmsnorm
from kernels.runtime import tensor_checks

pytestmark = pytest.mark.skipif(
    not tensor_checks.supports_pdl(torch.device("cuda")), reason="PDL needs sm_90+"
)


def chain(x: torch.Tensor, ws: list[torch.Tensor], norm: torch.Tensor, pdl: bool) -> torch.Tensor:
    """Norm -> split-K GEMV (+reduce) -> norm -> gated GEMV (+reduce), four times over: every
    kernel reads what the one before it wrote."""
    residual = torch.zeros_like(x)
    split = GemvConfig(block_n=64, block_k=128, split_k=4)
    for w_up, w_down in zip(ws[::2], ws[1::2], strict=True):
        normed, residual = rmsnorm(x, norm, 1e-5, residual, pdl=pdl)
        up = gemv(normed, w_up, split, pdl=pdl)
        normed, residual = rmsnorm(up[:, : x.shape[1]], norm, 1e-5, residual, pdl=pdl)
        gate_up = gemv(normed, w_up, pdl=pdl)
        x = gemv(gate_up, w_down, split, gated=True, pdl=pdl)
    return x


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_pdl_chain_equals_plain_launches_eager_and_in_a_graph(rows: int) -> None:
    torch.manual_seed(0)
    hidden, inter = 1024, 2048
    ws = []
    for _ in range(4):
        ws.append(torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / 32)
        ws.append(torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) / 45)
    norm = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    plain = chain(x, ws, norm, pdl=False)
    assert torch.equal(chain(x, ws, norm, pdl=True), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x, ws, norm, pdl=True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, chain(x, ws, norm, pdl=False))
