"""The attention specializations compiled at start-up: the decode list
(meshllm_kernels/attention/decode_variants.py) holds every choice a serving step can make, and
the warm-up launches each of them, and the paged prefill (prefill_variants.py), at each table
width."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshllm_kernels.attention import decode_variants as dv
from meshllm_kernels.attention import paged_decode
from meshllm_kernels.attention import prefill_variants as pv
from meshllm_kernels.attention.paged_decode import default_num_splits, launch_choice
from tests.kernels.paged_batch import make_paged_batch

# (kv heads, head_dim, SMs, sequences, longest context, window): the H200's 132 SMs at
# Llama-3-8B's 8 kv heads (past MANY_PROGRAMS programs at 128 sequences), a small GPU, a window
SHAPES = [(8, 128, 132, 160, 1300, 0), (2, 32, 4, 40, 700, 0), (8, 128, 132, 70, 1300, 300)]


def every_choice(kv_heads: int, head_dim: int, sms: int, seqs: int, longest: int, window: int):  # type: ignore[no-untyped-def]
    """What paged_decode_attention chooses at every sequence count and every context length."""
    found = set()
    for d in range(1, seqs + 1):
        for length in range(1, longest + 1):
            span = min(length, window) if window else length
            splits = default_num_splits(d, kv_heads, span, sms)
            found.add(launch_choice(d, kv_heads, splits, window, head_dim, 2, sms))
    return found


@pytest.mark.parametrize("gpu_tiles", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_list_is_every_choice_serving_makes(
    shape: tuple[int, ...], gpu_tiles: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if gpu_tiles:  # the tiles the GPU picks (the interpreter always takes its own)
        monkeypatch.setattr(paged_decode, "interpreting", lambda: False)
    kv_heads, head_dim, sms, seqs, longest, window = shape
    listed = dv.decode_variants(kv_heads, head_dim, 2, sms, seqs, longest, window)
    assert listed == every_choice(kv_heads, head_dim, sms, seqs, longest, window)
    assert len({c.num_splits for c in listed}) > 2  # the shapes do reach several split counts


@pytest.fixture
def one_sequence_cache(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a paged fp16 cache of one sequence: 8 query heads over 2 kv heads of 32, a copy)."""
    batch = make_paged_batch(
        [5], [1], num_heads=8, num_kv_heads=2, head_dim=32, page=16, dtype=torch.float16,
        device=device,
    )  # fmt: skip
    return batch.kv_cache.clone(), batch.kv_cache


def test_the_warmup_launches_each_choice_at_each_width(
    one_sequence_cache: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, original = one_sequence_cache
    launches: list[tuple[Any, ...]] = []
    real = dv.paged_decode_attention

    def recorded(q, kv_cache, tables, lens, **kw):  # type: ignore[no-untyped-def]
        out = real(q, kv_cache, tables, lens, **kw)
        assert torch.isfinite(out).all()
        launches.append((kw["num_splits"], kw["strided"], kw["tiles"], tables.shape[1]))
        return out

    monkeypatch.setattr(dv, "paged_decode_attention", recorded)
    variants = dv.decode_variants(2, 32, 2, 4, 40, 700)
    seconds = dv.compile_decode_variants(cache, 8, torch.float16, variants, {16, 44})
    assert seconds > 0
    expected = {(c.num_splits, c.strided, c.tiles, w) for c in variants for w in (16, 44)}
    assert set(launches) == expected and len(launches) == len(expected)
    assert torch.equal(cache, original)  # read, never written


def test_the_warmup_launches_the_paged_prefill_at_each_width(
    one_sequence_cache: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """meshllm_kernels/attention/prefill_variants.py: one causal launch per table width."""
    cache, original = one_sequence_cache
    launches: list[tuple[Any, ...]] = []
    real = pv.paged_prefill_attention

    def recorded(q, kv_cache, tables, cu, lens, **kw):  # type: ignore[no-untyped-def]
        out = real(q, kv_cache, tables, cu, lens, **kw)
        assert torch.isfinite(out).all()
        launches.append((tables.shape[1], kw["causal"], q.dtype, tuple(q.shape)))
        return out

    monkeypatch.setattr(pv, "paged_prefill_attention", recorded)
    assert pv.compile_prefill_variants(cache, 8, torch.float16, {16, 44}) > 0
    assert sorted(launches) == [(w, True, torch.float16, (1, 8, 32)) for w in (16, 44)]
    assert torch.equal(cache, original)  # read, never written
