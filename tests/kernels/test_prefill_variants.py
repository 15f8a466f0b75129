"""The paged prefill specializations compiled at start-up
(meshllm_kernels/attention/prefill_variants.py): one causal launch per table width, reading the
cache and writing nothing into it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshllm_kernels.attention import prefill_variants as pv
from tests.kernels.paged_batch import make_paged_batch


def test_the_warmup_launches_the_prefill_at_each_width(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_paged_batch(
        [5], [1], num_heads=8, num_kv_heads=2, head_dim=32, page=16, dtype=torch.float16,
        device=device,
    )  # fmt: skip
    cache = batch.kv_cache.clone()
    launches: list[tuple[Any, ...]] = []
    real = pv.paged_prefill_attention

    def recorded(q, kv_cache, tables, cu, lens, **kw):  # type: ignore[no-untyped-def]
        out = real(q, kv_cache, tables, cu, lens, **kw)
        assert torch.isfinite(out).all()
        launches.append((tables.shape[1], kw["causal"], q.dtype, tuple(q.shape)))
        return out

    monkeypatch.setattr(pv, "paged_prefill_attention", recorded)
    seconds = pv.compile_prefill_variants(cache, 8, torch.float16, {16, 44})
    assert seconds > 0
    assert sorted(launches) == [
        (16, True, torch.float16, (1, 8, 32)),
        (44, True, torch.float16, (1, 8, 32)),
    ]
    assert torch.equal(cache, batch.kv_cache)  # read, never written
