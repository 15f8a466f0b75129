"""meshllm_kernels/layers/fused_moe.py: the Triton grouped-GEMM MoE equals its reference and the
worker's grouped PyTorch path; every launcher check refuses bad input with a message."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.layers.fused_moe import align_pairs, fused_moe, fused_moe_reference
from services.worker.models.moe import experts_grouped, route


def problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, device: torch.device):
    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return [t.to(device) for t in (x, w13, w2, weights, ids)]


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(1, 4, 2, 32, 16), (19, 6, 2, 48, 40), (40, 8, 3, 64, 32)],
)
def test_kernel_equals_reference_and_grouped_path(
    device: torch.device, tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> None:
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, inter, device)
    out = fused_moe(x, w13, w2, weights, ids)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    grouped = experts_grouped(x, w13, w2, weights, ids)
    torch.testing.assert_close(grouped, expected, rtol=1e-4, atol=1e-4)


def test_align_pairs_blocks_hold_one_expert_each() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, block_expert = align_pairs(ids, num_experts=4, block_m=4)
    # expert 3 got nothing: no block; the static size (6 pairs + 4 experts x 3 pad, in blocks
    # of 4: 20 rows) ends in blocks of expert -1 that the kernel skips
    assert block_expert.tolist() == [0, 1, 2, -1, -1]
    pad = ids.numel()
    assert sorted_ids.tolist() == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad] + [pad] * 8


def test_align_pairs_reads_nothing_back_to_the_host() -> None:
    """The sizes depend only on the shapes (a CUDA graph can capture the alignment): two
    routings of the same shape, one spread and one all on one expert, give equal sizes."""
    spread = align_pairs(torch.tensor([[0, 1], [2, 3], [4, 5]]), num_experts=6, block_m=4)
    skewed = align_pairs(torch.tensor([[5, 4], [5, 4], [5, 4]]), num_experts=6, block_m=4)
    assert [t.shape for t in spread] == [t.shape for t in skewed]
    assert skewed[1].tolist()[:2] == [4, 5] and set(skewed[1].tolist()[2:]) == {-1}


def test_no_tokens_gives_an_empty_result(device: torch.device) -> None:
    x, w13, w2, weights, ids = problem(3, 4, 2, 32, 16, device)
    out = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: {**a, "x": a["x"].to(torch.int32)}, TypeError, "x has dtype"),
        (lambda a: {**a, "x": a["x"][0]}, ValueError, "x must have 2 dimensions"),
        (lambda a: {**a, "x": a["x"].t().contiguous().t()}, ValueError, "x must be contiguous"),
        (lambda a: {**a, "w13": a["w13"].double()}, TypeError, "w13 has dtype"),
        (lambda a: {**a, "w13": a["w13"][:, :, :16].contiguous()}, ValueError, "w13 must be"),
        (lambda a: {**a, "w2": a["w2"][:, :, :8].contiguous()}, ValueError, "w2 must be"),
        (lambda a: {**a, "ids": a["ids"].float()}, TypeError, "ids has dtype"),
        (lambda a: {**a, "ids": a["ids"][:2]}, ValueError, "must both be"),
        (lambda a: {**a, "weights": a["weights"][:, :1]}, ValueError, "must both be"),
        (lambda a: {**a, "ids": a["ids"] + 4}, ValueError, "expert ids must be in"),
        (lambda a: {**a, "ids": a["ids"] - 9}, ValueError, "expert ids must be in"),
    ],
)
def test_launcher_refuses_bad_input(
    device: torch.device, change: object, error: type[Exception], match: str
) -> None:
    x, w13, w2, weights, ids = problem(3, 4, 2, 32, 16, device)
    args = {"x": x, "w13": w13, "w2": w2, "weights": weights, "ids": ids}
    with pytest.raises(error, match=match):
        fused_moe(**change(args))  # type: ignore[operator]


def test_launcher_refuses_tensors_on_another_device() -> None:
    x, w13, w2, weights, ids = problem(3, 4, 2, 32, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="w13 is on meta"):
        fused_moe(x, w13.to("meta"), w2, weights, ids)
