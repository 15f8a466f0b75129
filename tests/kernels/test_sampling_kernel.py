"""The fused Gumbel-max kernel equals its PyTorch reference bit for bit: uniforms, noise, tokens.

On CPU this runs in Triton's interpreter (tests/kernels/conftest.py), so sizes stay small;
tests/gpu/test_sampling_cuda.py repeats the comparison compiled, at real sizes.
"""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.runtime import completion_counters
from meshllm_kernels.sampling import gumbel_kernel as sampling
from meshllm_kernels.sampling.bitmask import pack_bitmask
from meshllm_kernels.sampling.gumbel_kernel import (
    gumbel_argmax_reference,
    gumbel_argmax_triton,
    gumbel_noise_reference,
)
from meshllm_kernels.sampling.murmur3 import uniform32

VOCAB = 3000  # three kernel chunks per row at small batches, a ragged last block


def _batch(device: torch.device, rows: int = 4, vocab: int = VOCAB, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    inv_t = torch.tensor([1.0, 0.0, 2.0, 0.7, 1.0, 0.0, 1.3, 1.0][:rows], device=device)
    seeds = torch.tensor(
        [1, 2**63 + 5 - 2**64, 7, 123456789012345, -1, 3, 2**62, 99][:rows], device=device
    )
    positions = torch.tensor([0, 5, 2**30 + 3, 77, 1, 2, 3, 4][:rows], device=device)
    return logits, inv_t, seeds, positions


def test_uniforms_and_noise_equal_the_reference_bit_for_bit(device: torch.device) -> None:
    logits, inv_t, seeds, positions = _batch(device)
    u = torch.zeros(logits.shape, device=device)
    g = torch.zeros(logits.shape, device=device)
    gumbel_argmax_triton(logits, inv_t, seeds, positions, noise_out=(u, g))
    sampled = (inv_t != 0).cpu()
    tokens = torch.arange(VOCAB)
    ref_u = uniform32(seeds.cpu().unsqueeze(1), positions.cpu().unsqueeze(1), tokens)
    ref_g = gumbel_noise_reference(seeds.cpu(), positions.cpu(), VOCAB)
    assert torch.equal(u.cpu()[sampled].view(torch.int32), ref_u[sampled].view(torch.int32))
    assert torch.equal(g.cpu()[sampled].view(torch.int32), ref_g[sampled].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tokens_equal_the_reference(device: torch.device, dtype: torch.dtype) -> None:
    logits, inv_t, seeds, positions = _batch(device, rows=8, seed=1)
    logits = logits.to(dtype)
    for shift in range(3):  # three steps: new noise each time
        got = gumbel_argmax_triton(logits, inv_t, seeds, positions + shift)
        want = gumbel_argmax_reference(
            logits.cpu(), inv_t.cpu(), seeds.cpu(), positions.cpu() + shift
        )
        assert torch.equal(got.cpu(), want)
    greedy = (inv_t == 0).cpu()
    assert torch.equal(got.cpu()[greedy], logits.float().cpu().argmax(dim=1)[greedy])


def test_bitmask_full_and_indexed_equal_the_reference(device: torch.device) -> None:
    logits, inv_t, seeds, positions = _batch(device, seed=2)
    gen = torch.Generator().manual_seed(3)
    allowed = torch.rand(3, VOCAB, generator=gen) < 0.02
    allowed[2] = False
    allowed[2, 2999] = True  # the last token, in the ragged last word
    packed = pack_bitmask(allowed).to(device)
    index = torch.tensor([2, 0, -1, 1], dtype=torch.int32, device=device)
    got = gumbel_argmax_triton(logits, inv_t, seeds, positions, packed, index)
    want = gumbel_argmax_reference(
        logits.cpu(), inv_t.cpu(), seeds.cpu(), positions.cpu(), packed.cpu(), index.cpu()
    )
    assert torch.equal(got.cpu(), want)
    assert got[0].item() == 2999
    assert bool(allowed[0, got[1].item()]) and bool(allowed[1, got[3].item()])
    full = packed[[0, 1, 2, 0]]
    got = gumbel_argmax_triton(logits, inv_t, seeds, positions, full)
    want = gumbel_argmax_reference(
        logits.cpu(), inv_t.cpu(), seeds.cpu(), positions.cpu(), full.cpu()
    )
    assert torch.equal(got.cpu(), want)


def test_short_bitmask_disallows_the_tokens_it_does_not_cover(device: torch.device) -> None:
    logits, inv_t, seeds, positions = _batch(device, seed=4)
    logits[:, 40:] += 100.0
    short = torch.full((4, 2), -1, dtype=torch.int32, device=device)  # tokens 0..63 only
    got = gumbel_argmax_triton(logits, inv_t, seeds, positions, short)
    assert bool((got < 64).all()) and bool((got >= 40).all())


def test_ties_and_all_masked_rows_go_to_the_smallest_id(device: torch.device) -> None:
    logits = torch.full((4, VOCAB), -5.0, device=device)
    logits[0, [1500, 2500]] = 7.0  # greedy tie across kernel chunks
    logits[1] = float("-inf")  # nothing allowed, greedy
    logits[2] = float("-inf")  # nothing allowed, sampled
    logits[3, 2999] = 0.0
    inv_t = torch.tensor([0.0, 0.0, 1.0, 1.0], device=device)
    seeds = torch.arange(4, device=device)
    positions = torch.zeros(4, dtype=torch.int64, device=device)
    got = gumbel_argmax_triton(logits, inv_t, seeds, positions)
    assert got.tolist()[:3] == [1500, 0, 0]
    want = gumbel_argmax_reference(logits.cpu(), inv_t.cpu(), seeds.cpu(), positions.cpu())
    assert torch.equal(got.cpu(), want)


def test_strided_rows_and_int32_positions(device: torch.device) -> None:
    logits, inv_t, seeds, positions = _batch(device, seed=5)
    wide = torch.zeros(4, VOCAB + 77, device=device)
    wide[:, :VOCAB] = logits
    view = wide[:, :VOCAB]
    got = gumbel_argmax_triton(view, inv_t, seeds, positions.to(torch.int32) % 2**30)
    want = gumbel_argmax_reference(logits.cpu(), inv_t.cpu(), seeds.cpu(), positions.cpu() % 2**30)
    assert torch.equal(got.cpu(), want)


def test_empty_batch(device: torch.device) -> None:
    empty = torch.empty(0, device=device)
    got = gumbel_argmax_triton(torch.empty(0, 10, device=device), empty, empty.long(), empty.long())
    assert got.shape == (0,) and got.dtype == torch.int64


def _args(device: torch.device) -> dict[str, object]:
    logits, inv_t, seeds, positions = _batch(device, rows=2, vocab=64)
    return {"logits": logits, "inv_temperature": inv_t, "seeds": seeds, "positions": positions}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"logits": lambda a: a.long()}, TypeError, "logits has dtype"),
        ({"logits": lambda a: a[0]}, ValueError, "logits must have 2 dimensions"),
        ({"logits": lambda a: a.t().contiguous().t()}, ValueError, "contiguous last dimension"),
        ({"logits": lambda a: a[:, :0]}, ValueError, "empty vocabulary"),
        ({"inv_temperature": lambda a: a.double()}, TypeError, "inv_temperature has dtype"),
        ({"inv_temperature": lambda a: a[:1]}, ValueError, "inv_temperature has shape"),
        ({"seeds": lambda a: a.int()}, TypeError, "seeds has dtype"),
        ({"seeds": lambda a: a.to("meta")}, ValueError, "seeds is on meta"),
        ({"positions": lambda a: a.float()}, TypeError, "positions has dtype"),
        ({"positions": lambda a: a.reshape(2, 1)}, ValueError, "positions must have 1"),
        ({"bitmask": lambda a: torch.zeros(2, 2, dtype=torch.int64)}, TypeError, "bitmask has"),
        ({"bitmask": lambda a: torch.zeros(3, 2, dtype=torch.int32)}, ValueError, "3 rows for 2"),
        ({"bitmask": lambda a: torch.zeros(2, 0, dtype=torch.int32)}, ValueError, "no words"),
        ({"bitmask_index": lambda a: torch.zeros(2, dtype=torch.int32)}, ValueError, "without"),
    ],
)
def test_input_errors(device: torch.device, change, error, match) -> None:
    args = _args(device)
    args["bitmask"] = None
    args["bitmask_index"] = None
    for key, fn in change.items():
        base = args[key] if args[key] is not None else None
        args[key] = fn(base)
        if isinstance(args[key], torch.Tensor) and args[key].device.type == "cpu":
            args[key] = args[key].to(device)
    with pytest.raises(error, match=match):
        gumbel_argmax_triton(**args)  # type: ignore[arg-type]


def test_bitmask_index_and_noise_out_checks(device: torch.device) -> None:
    args = _args(device)
    bitmask = torch.zeros(1, 2, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="bitmask_index has dtype"):
        gumbel_argmax_triton(
            **args,
            bitmask=bitmask,  # type: ignore[arg-type]
            bitmask_index=torch.zeros(2, device=device),
        )
    with pytest.raises(ValueError, match="bitmask_index has shape"):
        gumbel_argmax_triton(
            **args,
            bitmask=bitmask,  # type: ignore[arg-type]
            bitmask_index=torch.zeros(3, dtype=torch.int32, device=device),
        )
    bad = torch.zeros(2, 63, device=device)
    with pytest.raises(ValueError, match=r"noise_out\[0\] has shape"):
        gumbel_argmax_triton(**args, noise_out=(bad, bad))  # type: ignore[arg-type]


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = _args(torch.device("cpu"))
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        gumbel_argmax_triton(**args)  # type: ignore[arg-type]


def _tables(device: torch.device, table: int = 7):
    """Per-state-row tables [R]: greedy and sampled rows, seeds over the full uint64 range."""
    inv_t = torch.tensor([0.8, 0.0, 1.0, 2.0, 0.0, 1.5, 0.5][:table], device=device)
    seeds = torch.tensor(
        [11, -3, 2**63 - 1, 42, 7, 123456789012345, -(2**63)][:table], device=device
    )
    return inv_t, seeds


@pytest.mark.parametrize("vocab", [1000, 5000])
@pytest.mark.parametrize("row_dtype", [torch.int64, torch.int32])
def test_state_rows_equal_the_reference_on_gathered_tables(
    device: torch.device, vocab: int, row_dtype: torch.dtype
) -> None:
    """rows [5, 0, 5]: a repeated row, a vocabulary that is no multiple of a chunk; at 5000
    tokens each row has several chunks for the fused reduction to merge."""
    logits, _, _, positions = _batch(device, rows=3, vocab=vocab, seed=6)
    inv_t, seeds = _tables(device)
    inv_t[0] = 0.0  # rows 5 (sampled) and 0 (greedy)
    rows = torch.tensor([5, 0, 5], dtype=row_dtype, device=device)
    for shift in range(2):
        got = gumbel_argmax_triton(logits, inv_t, seeds, positions + shift, rows=rows)
        want = gumbel_argmax_reference(
            logits.cpu(), inv_t.cpu()[[5, 0, 5]], seeds.cpu()[[5, 0, 5]], positions.cpu() + shift
        )
        assert got.dtype == torch.int64
        assert torch.equal(got.cpu(), want)
    assert got[1].item() == logits[1].argmax().item()


def test_state_tables_may_be_strided_columns(device: torch.device) -> None:
    """The sampler's tables are columns of its parameter matrix (row_params.py)."""
    logits, _, _, positions = _batch(device, rows=3, vocab=5000, seed=12)
    inv_t, seeds = _tables(device)
    floats = torch.zeros(7, 3, device=device)
    ints = torch.zeros(7, 4, dtype=torch.int64, device=device)
    floats[:, 1], ints[:, 2] = inv_t, seeds
    rows = torch.tensor([6, 2, 3], device=device)
    got = gumbel_argmax_triton(logits, floats[:, 1], ints[:, 2], positions, rows=rows)
    assert torch.equal(got, gumbel_argmax_triton(logits, inv_t, seeds, positions, rows=rows))
    want = gumbel_argmax_reference(
        logits.cpu(), inv_t.cpu()[[6, 2, 3]], seeds.cpu()[[6, 2, 3]], positions.cpu()
    )
    assert torch.equal(got.cpu(), want)


def test_state_rows_with_bitmask_and_noise(device: torch.device) -> None:
    logits, _, _, positions = _batch(device, rows=3, vocab=VOCAB, seed=7)
    inv_t, seeds = _tables(device)
    rows = torch.tensor([3, 1, 6], device=device)
    allowed = torch.rand(2, VOCAB, generator=torch.Generator().manual_seed(8)) < 0.05
    packed = pack_bitmask(allowed).to(device)
    index = torch.tensor([1, -1, 0], dtype=torch.int32, device=device)  # per batch row
    u = torch.zeros(logits.shape, device=device)
    g = torch.zeros(logits.shape, device=device)
    got = gumbel_argmax_triton(
        logits, inv_t, seeds, positions, packed, index, noise_out=(u, g), rows=rows
    )
    want = gumbel_argmax_reference(
        logits.cpu(), inv_t.cpu()[[3, 1, 6]], seeds.cpu()[[3, 1, 6]], positions.cpu(),
        packed.cpu(), index.cpu(),
    )  # fmt: skip
    assert torch.equal(got.cpu(), want)
    ref_g = gumbel_noise_reference(seeds.cpu()[[3, 6]], positions.cpu()[[0, 2]], VOCAB)
    assert torch.equal(g.cpu()[[0, 2]].view(torch.int32), ref_g.view(torch.int32))


def test_fused_reduction_ties_go_to_the_lowest_id(device: torch.device) -> None:
    vocab = 5000
    logits = torch.full((4, vocab), 2.5, device=device)  # constant rows: every chunk ties
    logits[1] = -1.0
    logits[1, [4500, 1200, 3900]] = 9.0  # the maximum in three chunks
    logits[2] = float("-inf")  # every score -inf: chunk 0, token 0 (as the torch path)
    logits[3, 4999] = 3.0  # the maximum alone, in the last (ragged) chunk
    inv_t = torch.zeros(4, device=device)
    seeds = torch.arange(4, device=device)
    positions = torch.zeros(4, dtype=torch.int64, device=device)
    rows = torch.tensor([3, 2, 1, 0], device=device)
    for kwargs in ({}, {"rows": rows}):
        got = gumbel_argmax_triton(logits, inv_t, seeds, positions, **kwargs)
        assert got.tolist() == [0, 1200, 0, 4999]
    inv_t[2] = 1.0  # sampled, nothing allowed
    got = gumbel_argmax_triton(logits, inv_t, seeds, positions)
    assert got[2].item() == 0


def test_feed_receives_the_tokens_at_their_state_rows(device: torch.device) -> None:
    logits, _, _, positions = _batch(device, rows=3, vocab=5000, seed=9)
    inv_t, seeds = _tables(device)
    rows = torch.tensor([4, 0, 6], device=device)
    feed = torch.full((7,), -1, dtype=torch.int64, device=device)
    got = gumbel_argmax_triton(logits, inv_t, seeds, positions, rows=rows, feed=feed)
    want = torch.full((7,), -1, dtype=torch.int64)
    want[[4, 0, 6]] = got.cpu()
    assert torch.equal(feed.cpu(), want)
    assert torch.equal(
        got.cpu(),
        gumbel_argmax_reference(
            logits.cpu(), inv_t.cpu()[[4, 0, 6]], seeds.cpu()[[4, 0, 6]], positions.cpu()
        ),
    )


def test_counters_reset_and_repeated_calls_agree(device: torch.device) -> None:
    logits, _, _, positions = _batch(device, rows=3, vocab=5000, seed=10)
    inv_t, seeds = _tables(device)
    rows = torch.tensor([2, 5, 1], device=device)
    completion_counters.clear()
    first = gumbel_argmax_triton(logits, inv_t, seeds, positions, rows=rows)
    assert completion_counters.allocated(sampling.COUNTERS), "the fused reduction never ran"
    assert completion_counters.all_zero()
    second = gumbel_argmax_triton(logits, inv_t, seeds, positions, rows=rows)
    assert torch.equal(first, second)
    assert completion_counters.all_zero()


def test_torch_reduction_without_counters_gives_the_same_tokens_and_feed(
    device: torch.device, monkeypatch
) -> None:
    logits, _, _, positions = _batch(device, rows=3, vocab=5000, seed=11)
    logits[0] = float("-inf")
    inv_t, seeds = _tables(device)
    rows = torch.tensor([1, 3, 5], device=device)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(completion_counters, "counters", lambda *args: None)
        feed = torch.full((7,), -1, dtype=torch.int64, device=device)
        tokens = gumbel_argmax_triton(logits, inv_t, seeds, positions, rows=rows, feed=feed)
        results.append((tokens.cpu(), feed.cpu()))
    (fused_tokens, fused_feed), (torch_tokens, torch_feed) = results
    assert torch.equal(fused_tokens, torch_tokens) and torch.equal(fused_feed, torch_feed)
    assert fused_tokens[0].item() == 0 and fused_feed[1].item() == 0


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"feed": torch.zeros(2, dtype=torch.int64)}, ValueError, "feed given without rows"),
        ({"rows": torch.zeros(2)}, TypeError, "rows has dtype"),
        ({"rows": torch.zeros(2, 1, dtype=torch.int64)}, ValueError, "rows must have 1"),
        ({"rows": torch.zeros(3, dtype=torch.int64)}, ValueError, "rows has shape"),
        (  # strided where it lives (a copy to the GPU would be contiguous)
            {"rows": lambda d: torch.zeros(4, dtype=torch.int64, device=d)[::2]},
            ValueError,
            "rows must be contig",
        ),
        (
            {"rows": torch.zeros(2, dtype=torch.int64), "seeds": torch.zeros(3, dtype=torch.int64)},
            ValueError,
            "seeds has shape",
        ),
        (
            {"rows": torch.zeros(2, dtype=torch.int64), "inv_temperature": torch.zeros(0)},
            ValueError,
            "inv_temperature is an empty state table",
        ),
        (
            {"rows": torch.zeros(2, dtype=torch.int64), "feed": torch.zeros(2, dtype=torch.int32)},
            TypeError,
            "feed has dtype",
        ),
        (
            {"rows": torch.zeros(2, dtype=torch.int64), "feed": torch.zeros(3, dtype=torch.int64)},
            ValueError,
            "feed has shape",
        ),
    ],
)
def test_rows_and_feed_errors(device: torch.device, change, error, match) -> None:
    args = _args(device)
    args.update({k: v(device) if callable(v) else v.to(device) for k, v in change.items()})
    with pytest.raises(error, match=match):
        gumbel_argmax_triton(**args)  # type: ignore[arg-type]
