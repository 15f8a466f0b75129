"""The sampler's warm-up launches the draw kernel once per specialization the worker can use
(services/worker/sampling/draw_variants.py), through the Triton interpreter here; on the H200
tests/gpu/test_compile_watch_cuda.py checks that nothing compiles after it."""

from __future__ import annotations

import pytest
import torch

from services.worker.sampling import SamplingState
from services.worker.sampling.draw_variants import compile_draws, draw_variants
from shared.protocol import SamplingParams

V = 300  # not a multiple of 32: the bitmask's last word is partial


def test_variants_are_every_draw_sample_launches() -> None:
    """Feed only without a bitmask (sample() lets the kernel write the feed only then), each
    with the model's logits and with an fp32 copy; an fp32 model has the one dtype."""
    bf16 = draw_variants(torch.bfloat16)
    assert len(bf16) == 6
    assert {v.logits_dtype for v in bf16} == {torch.bfloat16, torch.float32}
    assert not any(v.feed and v.bitmask for v in bf16)
    assert {(v.feed, v.bitmask) for v in bf16} == {(True, False), (False, False), (False, True)}
    assert len(draw_variants(torch.float32)) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compile_draws_launches_each_variant_on_scratch_tensors(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    from meshllm_kernels.sampling import gumbel_kernel

    state = SamplingState(4, V)
    state.add_request(3, SamplingParams(temperature=0.7, seed=11), [1, 2], [])
    before = (state.inv_temperature.clone(), state.seed.clone())
    launched: list[tuple[torch.dtype, int, bool, bool, bool]] = []
    real = gumbel_kernel.gumbel_argmax_triton

    def recording(logits: torch.Tensor, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        inv_temperature, seeds, _, bitmask = (*args, None)[:4]
        # the sampler's own columns, as sample() passes them: their strides are specialized on
        assert inv_temperature.stride() == state.inv_temperature.stride()
        assert seeds.stride() == state.seed.stride()
        launched.append(
            (
                logits.dtype,
                logits.stride(0),
                kwargs.get("feed") is not None,
                bitmask is not None,
                kwargs.get("rows") is not None,
            )
        )
        out = real(logits, *args, **kwargs)  # type: ignore[arg-type]
        assert torch.equal(out, logits.float().argmax(-1))  # rows 0 and 1 are greedy
        return out

    monkeypatch.setattr(gumbel_kernel, "gumbel_argmax_triton", recording)
    logits = torch.randn(2, V).to(dtype)
    assert compile_draws(state, logits) == len(draw_variants(dtype))
    expected = {(v.logits_dtype, V, v.feed, v.bitmask, True) for v in draw_variants(dtype)}
    assert set(launched) == expected and len(launched) == len(expected)
    # the sampler's own tables are untouched (scratch copies were drawn with)
    assert torch.equal(state.inv_temperature, before[0])
    assert torch.equal(state.seed, before[1])
