"""RMSNorm / GEMV / split-K reduce launched as the decode step's PDL chain
(meshllm_kernels/runtime/pdl.py):
each kernel waits for its predecessor's grid before reading, so the chain launched back to back
computes exactly what it computes with every launch finished before the next is issued, eagerly
and inside a CUDA graph."""

from __future__ import annotations

from typing import TypeVar

import pytest
import torch

from meshllm_kernels.decode_chain.gemv import GemvConfig, gemv
from meshllm_kernels.layers.rmsnorm import rmsnorm
from meshllm_kernels.runtime import tensor_checks

pytestmark = pytest.mark.skipif(
    not tensor_checks.supports_pdl(torch.device("cuda")), reason="PDL needs sm_90+"
)
T = TypeVar("T")


def chain(x: torch.Tensor, ws: list[torch.Tensor], norm: torch.Tensor, wait: bool) -> torch.Tensor:
    """Norm -> split-K GEMV (+reduce) -> norm -> gated GEMV (+reduce), four times over: every
    kernel reads what the one before it wrote. `wait`: synchronize after every launcher, so no
    launch overlaps its predecessor (the order the chain must reproduce)."""

    def step(out: T) -> T:
        if wait:
            torch.cuda.synchronize()
        return out

    residual = torch.zeros_like(x)
    split = GemvConfig(block_n=64, block_k=128, split_k=4)
    for w_up, w_down in zip(ws[::2], ws[1::2], strict=True):
        normed, residual = step(rmsnorm(x, norm, 1e-5, residual))
        up = step(gemv(normed, w_up, split))
        normed, residual = step(rmsnorm(up[:, : x.shape[1]], norm, 1e-5, residual))
        gate_up = step(gemv(normed, w_up))
        x = step(gemv(gate_up, w_down, split, gated=True))
    return x


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_pdl_chain_equals_launches_one_at_a_time_eager_and_in_a_graph(rows: int) -> None:
    torch.manual_seed(0)
    hidden, inter = 1024, 2048
    ws = []
    for _ in range(4):
        ws.append(torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / 32)
        ws.append(torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) / 45)
    norm = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    one_at_a_time = chain(x, ws, norm, wait=True)
    assert torch.equal(chain(x, ws, norm, wait=False), one_at_a_time)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x, ws, norm, wait=False)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, chain(x, ws, norm, wait=True))
