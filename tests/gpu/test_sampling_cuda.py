"""The fused Gumbel-max sampler compiled on the GPU at real sizes (vocab 128256, batch 1..256):
tokens equal the PyTorch reference's, with greedy and sampled rows mixed and with a grammar
bitmask, and its noise equals the CPU reference bit for bit (same seed, position and token ->
same bits on every device). tests/kernels/test_sampling_kernel.py checks the same at small
sizes in the interpreter."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.sampling.bitmask import pack_bitmask
from meshllm_kernels.sampling.gumbel_kernel import (
    gumbel_argmax_reference,
    gumbel_argmax_triton,
    gumbel_noise_reference,
)

VOCAB = 128256


def _inputs(batch: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, VOCAB, generator=gen) * 4).to(dtype).cuda()
    inv_t = 1.0 / (torch.rand(batch, generator=gen) * 1.2 + 0.3)
    inv_t[torch.rand(batch, generator=gen) < 0.25] = 0.0  # greedy rows among sampled ones
    seeds = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 2**31, (batch,), generator=gen, dtype=torch.int64)
    return logits, inv_t.cuda(), seeds.cuda(), positions.cuda()


@pytest.mark.parametrize("bitmask", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_tokens_equal_the_reference(batch: int, dtype: torch.dtype, bitmask: bool) -> None:
    logits, inv_t, seeds, positions = _inputs(batch, dtype, seed=batch)
    packed = index = None
    if bitmask:
        gen = torch.Generator().manual_seed(batch + 1)
        allowed = torch.rand(max(1, batch // 2), VOCAB, generator=gen) < 0.1
        packed = pack_bitmask(allowed).cuda()
        index = torch.randint(-1, packed.shape[0], (batch,), generator=gen, dtype=torch.int32)
        index = index.cuda()
    for step in range(4):
        got = gumbel_argmax_triton(logits, inv_t, seeds, positions + step, packed, index)
        want = gumbel_argmax_reference(logits, inv_t, seeds, positions + step, packed, index)
        assert torch.equal(got, want), f"step {step}: {int((got != want).sum())} tokens differ"


def test_noise_and_tokens_equal_the_cpu_reference() -> None:
    logits, inv_t, seeds, positions = _inputs(16, torch.float32, seed=99)
    inv_t[inv_t == 0] = 1.0  # every row sampled: the noise decides
    uniforms = torch.empty(logits.shape, device="cuda")
    noise = torch.empty(logits.shape, device="cuda")
    tokens = gumbel_argmax_triton(logits, inv_t, seeds, positions, noise_out=(uniforms, noise))
    cpu_noise = gumbel_noise_reference(seeds.cpu(), positions.cpu(), VOCAB)
    assert torch.equal(noise.cpu().view(torch.int32), cpu_noise.view(torch.int32))
    cpu_tokens = gumbel_argmax_reference(logits.cpu(), inv_t.cpu(), seeds.cpu(), positions.cpu())
    assert torch.equal(tokens.cpu(), cpu_tokens)
