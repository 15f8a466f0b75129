"""Paged prefill/extend attention: the Triton kernel against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention.paged_prefill import (
    attention_mask,
    paged_prefill_attention,
    paged_prefill_reference,
)
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3
from tests.kernels.paged_batch import make_paged_batch, tolerance

# (seq_len, q_len): fresh prompt, extend after a prefix, single-token extend, long extend
# crossing many pages, a sequence with no new queries this step.
MIXED = [(7, 7), (18, 5), (31, 1), (45, 29), (12, 0)]


def _run(batch, **kw):  # type: ignore[no-untyped-def]
    out = torch.full_like(batch.q, float("nan"))
    paged_prefill_attention(
        batch.q, batch.kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
        out=out, **batch.scales, **kw,
    )  # fmt: skip
    ref = paged_prefill_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
        **batch.scales, **kw,
    )  # fmt: skip
    assert not out.isnan().any(), "some output rows were never written"
    return out.float(), ref.float()


@pytest.mark.parametrize(
    ("dtype", "heads", "page", "window"),
    [
        (torch.float16, (4, 4), 4, None),
        (torch.float16, (8, 2), 16, None),
        (torch.bfloat16, (6, 2), 4, 9),
        (torch.float16, (4, 1), 8, 3),
        (torch.float32, (2, 2), 5, 20),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_reference(device, dtype, heads, page, window, causal) -> None:  # type: ignore[no-untyped-def]
    seq_lens, q_lens = zip(*MIXED, strict=True)
    batch = make_paged_batch(
        list(seq_lens), list(q_lens), num_heads=heads[0], num_kv_heads=heads[1], head_dim=32,
        page=page, dtype=dtype, device=device,
    )  # fmt: skip
    out, ref = _run(batch, causal=causal, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("per_head_scale", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_fp8_cache_dequantizes_on_load(device, per_head_scale, causal) -> None:  # type: ignore[no-untyped-def]
    batch = make_paged_batch(
        [9, 26, 40], [9, 3, 17], num_heads=4, num_kv_heads=2, head_dim=32, page=8,
        dtype=torch.float16, device=device, cache_dtype=FP8_E4M3,
        per_head_scale=per_head_scale,
    )  # fmt: skip
    out, ref = _run(batch, causal=causal, sliding_window=11)
    torch.testing.assert_close(out, ref, atol=tolerance(torch.float16), rtol=0)
    # The scales matter: dequantizing with 1.0 would give a different attention.
    unscaled = paged_prefill_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
        causal=causal, sliding_window=11, k_scale=1.0, v_scale=1.0,
    ).float()  # fmt: skip
    assert (unscaled - out).abs().max() > 0.1


def test_head_dim_not_a_power_of_two(device) -> None:  # type: ignore[no-untyped-def]
    batch = make_paged_batch(
        [20, 11], [6, 11], num_heads=4, num_kv_heads=2, head_dim=24, page=4,
        dtype=torch.float16, device=device,
    )  # fmt: skip
    out, ref = _run(batch)
    torch.testing.assert_close(out, ref, atol=tolerance(torch.float16), rtol=0)


def test_non_causal_draft_block_sees_the_whole_block(device) -> None:  # type: ignore[no-untyped-def]
    """CONTRACTS: qlen=2 over seq_len=10, non-causal: row 0 sees all 10 positions.

    With all keys equal the softmax is uniform, so row 0's output is the mean of the values
    it sees: the mean of all 10 values, not of the first 9 as a causal (flag-ignoring) kernel
    would give.
    """
    batch = make_paged_batch(
        [10], [2], num_heads=2, num_kv_heads=2, head_dim=16, page=4, dtype=torch.float32,
        device=device,
    )  # fmt: skip
    batch.kv_cache[0] = 0.5  # every key equal: uniform attention over the visible keys
    out, ref = _run(batch, causal=False)
    causal_out, _ = _run(batch, causal=True)
    from meshllm_kernels.attention.paged_cache import gather_sequence_kv

    _, v = gather_sequence_kv(batch.kv_cache, batch.block_tables[0], 10)
    torch.testing.assert_close(out[0], v.mean(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(causal_out[0], v[:9].mean(0), atol=1e-5, rtol=0)
    assert (out[0] - causal_out[0]).abs().max() > 1e-3
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # Row 1 is the block's last query: it sees all 10 keys either way.
    torch.testing.assert_close(out[1], causal_out[1], atol=1e-5, rtol=0)


def test_non_causal_random_keys_differ_from_causal(device) -> None:  # type: ignore[no-untyped-def]
    batch = make_paged_batch(
        [10], [2], num_heads=4, num_kv_heads=2, head_dim=32, page=4, dtype=torch.float16,
        device=device,
    )  # fmt: skip
    out, ref = _run(batch, causal=False)
    causal_out, causal_ref = _run(batch, causal=True)
    torch.testing.assert_close(out, ref, atol=tolerance(torch.float16), rtol=0)
    torch.testing.assert_close(causal_out, causal_ref, atol=tolerance(torch.float16), rtol=0)
    assert (out[0] - causal_out[0]).abs().max() > 1e-2


def test_attention_mask_window_edges() -> None:
    """Window W: position p sees keys in (p - W, p]; non-causal lifts only the upper edge."""
    mask = attention_mask(2, 10, causal=True, sliding_window=3)
    assert mask[0].nonzero().flatten().tolist() == [6, 7, 8]
    assert mask[1].nonzero().flatten().tolist() == [7, 8, 9]
    mask = attention_mask(2, 10, causal=False, sliding_window=3)
    assert mask[0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert attention_mask(2, 10, causal=False, sliding_window=None).all()
