"""The one-row GEMV with its weight loads ahead of the PDL wait
(meshllm_kernels/decode_chain/gemv_ws.py) at
the Llama-3-8B layer shapes: it takes the products meshllm_kernels/decode_chain/gemv.py routes to
it, matches an fp64 reference as the tensor-core kernel does, sums each split in the same K ranges,
and is deterministic in a CUDA graph chain."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.decode_chain import gemv as gemv_mod
from meshllm_kernels.decode_chain.gemv import WS_CONFIGS, gemv, gemv_partials
from meshllm_kernels.runtime import tensor_checks
from meshllm_kernels.runtime.tensor_checks import sm_count

pytestmark = pytest.mark.skipif(
    not tensor_checks.supports_pdl(torch.device("cuda")), reason="TMA and PDL need sm_90+"
)

SHAPES = sorted(WS_CONFIGS)


def operands(n: int, k: int, gated: bool = False, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w


def exact(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> torch.Tensor:
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up  # rounded to bf16 as the kernels round
    return x.double() @ w.double().t()


@pytest.mark.parametrize("shape", SHAPES)
def test_one_row_products_take_the_ws_kernel(shape: tuple[int, int]) -> None:
    n, k = shape
    x, w = operands(n, k)
    assert gemv_mod._checked(x, w, None, False).ws
    two_rows = torch.cat([x, x])
    assert not gemv_mod._checked(two_rows, w, None, False).ws  # batch 2: tensor cores
    explicit = gemv_mod.GemvConfig()
    assert not gemv_mod._checked(x, w, explicit, False).ws  # a caller's config wins


@pytest.mark.parametrize("shape", SHAPES)
def test_partials_sum_each_split_of_k(shape: tuple[int, int]) -> None:
    n, k = shape
    x, w = operands(n, k, seed=1)
    part = gemv_partials(x, w)
    split = WS_CONFIGS[shape].split_k
    assert part.shape == (split, 1, n) and part.dtype == torch.float32
    width = k // split
    for s in range(split):
        cols = slice(s * width, (s + 1) * width)
        want = x[:, cols].double() @ w[:, cols].double().t()
        torch.testing.assert_close(part[s].double(), want, rtol=1e-4, atol=1e-4)


# Every shape plain; the down projection also gated (the only one that takes a gated input).
PRODUCTS = [(shape, False) for shape in SHAPES] + [((4096, 14336), True)]


@pytest.mark.parametrize(("shape", "gated"), PRODUCTS)
def test_product_matches_the_tensor_core_kernel_within_rounding(
    shape: tuple[int, int], gated: bool
) -> None:
    """Against an fp64 reference, with the tensor-core kernel's error at the same shape (the
    path of 2+ rows; here given its own tiles, which a caller's config pins) as the bar."""
    n, k = shape
    x, w = operands(n, k, gated, seed=2)
    ws = gemv(x, w, gated=gated).double()
    tiles = gemv_mod.H200_CONFIGS.get(shape) or gemv_mod.heuristic_config(n, k, sm_count(x.device))
    assert not gemv_mod._checked(x, w, tiles, gated).ws
    tc = gemv(x, w, tiles, gated=gated).double()
    want = exact(x, w, gated)
    ws_err = (ws - want).abs().max().item()
    tc_err = (tc - want).abs().max().item()
    assert ws_err <= 1.5 * tc_err + 1e-3, (ws_err, tc_err)
    # Both round one fp32 sum to bf16: they differ by at most one ulp, and rarely.
    ulp = want.abs().clamp_min(1e-2) * 2.0**-7
    assert bool(((ws - tc).abs() <= ulp).all())
    assert (ws != tc).float().mean().item() < 0.05


def test_a_graph_of_chained_products_replays_deterministically() -> None:
    """qkv -> o -> gate_up -> down, each reading what the one before wrote, captured with PDL:
    every replay equals the eager chain bit for bit."""
    ws = {shape: operands(*shape, seed=3)[1] for shape in SHAPES}
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            qkv = gemv(x, ws[(6144, 4096)])
            o = gemv(qkv[:, :4096], ws[(4096, 4096)])
            gate_up = gemv(o, ws[(28672, 4096)])
            x = gemv(gate_up, ws[(4096, 14336)], gated=True)
        return x

    eager = chain(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        eager = chain(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
