"""The split of prefill spans for dense attention (services/worker/attention/dense_prefill.py):
which spans qualify, their rows/cache slots, the paged rest, and the CPU staying on its own path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.attention.dense_prefill import (
    DENSE_PREFILL_CHOICES,
    DensePrefill,
    dense_attention,
    dense_prefill_impl,
    reference_attention,
    span_runs,
    split_prefill_spans,
)
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.attention.table_width import table_width

BLOCK = 4


def _meta(query_lens: list[int], seq_lens: list[int], **kwargs: object) -> TritonAttentionMetadata:
    q, s = np.array(query_lens), np.array(seq_lens)
    tables = np.arange(1, 1 + 4 * len(q)).reshape(len(q), 4)
    starts = s - q
    pos = np.concatenate([np.arange(a, b) for a, b in zip(starts, s, strict=True)])
    rows = np.repeat(np.arange(len(q)), q)
    slots = tables[rows, pos // BLOCK] * BLOCK + pos % BLOCK
    return TritonAttentionMetadata.build(
        query_lens=q, seq_lens=s, block_tables=tables, block_size=BLOCK, slot_mapping=slots,
        num_kv_heads=2, device="cpu", backend=TritonPagedAttention(), **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_fresh_spans_are_those_without_a_cached_prefix() -> None:
    mask = split_prefill_spans(np.array([5, 3, 7, 1]), np.array([5, 9, 7, 4]))
    assert mask.tolist() == [True, False, True, False]


def test_split_rows_slots_and_paged_rest() -> None:
    # decode (ctx 6), fresh 3, extend 2 onto 5, fresh 2
    meta = _meta([1, 3, 2, 2], [7, 3, 7, 2])
    split = meta.dense_prefill
    assert split is not None and meta.num_decodes == 1
    # fresh rows 1..3 and 6..7 are not contiguous: an index tensor
    assert isinstance(split.rows, torch.Tensor) and split.rows.tolist() == [1, 2, 3, 6, 7]
    assert split.span_lens == [3, 2] and split.max_len == 3
    assert split.cu_seqlens.tolist() == [0, 3, 5]
    slots = meta.slot_mapping[split.rows]
    assert split.kv_slots.tolist() == slots.tolist()
    # fresh spans start at position 0: the first block of their own table (rows 1 and 3)
    assert (split.kv_slots // BLOCK).tolist() == [5, 5, 5, 13, 13]
    paged = split.paged
    assert paged is not None and paged.rows == slice(4, 6)
    assert paged.cu_seqlens_q.tolist() == [0, 2] and paged.seq_lens.tolist() == [7]
    # its 2 blocks, in a table as wide as the capacity (4 < 16 columns: table_width.py)
    assert paged.max_seqlen_q == 2 and paged.block_tables.tolist() == [[9, 10, 11, 12]]


def test_all_fresh_is_one_slice_and_no_paged_rest() -> None:
    split = _meta([1, 4, 6], [3, 4, 6]).dense_prefill
    assert split is not None and split.rows == slice(1, 11) and split.paged is None


def test_no_split_without_fresh_spans_with_a_window_or_when_disabled() -> None:
    assert _meta([1, 2], [5, 6]).dense_prefill is None  # decode + extend only
    assert _meta([1], [5]).dense_prefill is None  # decode only
    assert _meta([4], [4], sliding_window=3).dense_prefill is None
    assert _meta([4], [4], dense_prefill=False).dense_prefill is None
    forced = _meta([4], [4], dense_impl="sdpa").dense_prefill
    assert forced is not None and forced.impl == "sdpa"


def test_cpu_and_fp32_never_choose_a_dense_implementation() -> None:
    assert dense_prefill_impl(torch.device("cpu"), torch.bfloat16, 8, 2, 64) is None
    assert dense_prefill_impl(torch.device("cuda"), torch.float32, 8, 2, 64) is None


def test_sdpa_per_span_equals_the_float32_reference_with_grouped_heads() -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [3, 1, 6]
    n = sum(lens)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    out = dense_attention("sdpa", q, k, v, cu, lens, 6, 0.25)
    ref = reference_attention(q, k, v, lens, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # span boundaries matter: the single-token span attends to itself only (= its v)
    torch.testing.assert_close(out[3], v[3].repeat_interleave(2, 0), rtol=1e-6, atol=1e-6)


def test_attend_gathers_this_steps_cache_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 8, BLOCK, 2, 16, generator=gen)
    slots = np.array([9, 10, 11, 12, 20])  # blocks 2,2,2,3,5
    split = DensePrefill.build(
        first_row=0, query_lens=np.array([4, 1]), seq_lens=np.array([4, 1]),
        block_tables=np.array([[2, 3], [5, 0]]), block_size=BLOCK, slot_mapping=slots,
        device=torch.device("cpu"), impl="sdpa",
    )  # fmt: skip
    assert split is not None
    q = torch.randn(5, 4, 16, generator=gen)
    flat = cache.view(2, -1, 2, 16)[:, torch.from_numpy(slots)]
    expected = reference_attention(q, flat[0], flat[1], [4, 1], 0.25)
    torch.testing.assert_close(split.attend("sdpa", q, cache, 0.25), expected)


def test_eager_tables_are_as_wide_as_a_multiple_of_16_blocks_or_the_capacity() -> None:
    """Triton specializes the kernels on the table's row stride being 1 or a multiple of 16:
    eager tables take widths of one class (services/worker/attention/table_width.py)."""
    assert table_width(np.array([1]), 4, 100) == 16  # one block: not a width of 1
    assert table_width(np.array([3, 65]), 4, 100) == 32  # 17 blocks
    assert table_width(np.array([64]), 4, 100) == 16  # exactly 16
    assert table_width(np.array([399]), 4, 100) == 100  # 100 blocks: the capacity
    wide = np.arange(1, 1 + 2 * 40).reshape(2, 40)
    meta = TritonAttentionMetadata.build(
        query_lens=np.array([1, 3]), seq_lens=np.array([9, 3]), block_tables=wide,
        block_size=BLOCK, slot_mapping=np.array([8, 40, 41, 42]), num_kv_heads=2,
        device="cpu", backend=TritonPagedAttention(),  # type: ignore[arg-type]
    )  # fmt: skip
    assert meta.decode_block_tables is not None and meta.prefill_block_tables is not None
    assert meta.decode_block_tables.shape == (1, 16)
    assert meta.prefill_block_tables.shape == (1, 16)
    assert meta.decode_block_tables[0, :3].tolist() == [1, 2, 3]  # the row's own blocks first


def test_span_runs_group_consecutive_spans_of_one_length() -> None:
    assert span_runs([3, 3, 3, 5, 5, 3]) == [(0, 3, 3), (9, 2, 5), (19, 1, 3)]
    assert span_runs([7]) == [(0, 1, 7)] and span_runs([]) == []


def test_sdpa_batches_runs_of_equal_spans_and_keeps_their_boundaries() -> None:
    gen = torch.Generator().manual_seed(1)
    lens = [4, 4, 4, 2, 2, 7, 1]
    n = sum(lens)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for h in (6, 2, 2))
    cu = torch.tensor(np.concatenate(([0], np.cumsum(lens))), dtype=torch.int32)
    out = dense_attention("sdpa", q, k, v, cu, lens, 7, 0.3)
    torch.testing.assert_close(out, reference_attention(q, k, v, lens, 0.3), rtol=1e-5, atol=1e-5)
    # the first token of the second span of the first run attends to itself only
    torch.testing.assert_close(out[4], v[4].repeat_interleave(3, 0), rtol=1e-6, atol=1e-6)


def test_auto_takes_the_first_implementation_that_passed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """flash-varlen before sdpa (the module docstring: cuDNN's plan per new shape); CUDA need
    not be present: the probes' outcome is given."""
    cuda = torch.device("cuda")
    key = (str(cuda), str(torch.bfloat16), 8, 2, 64)
    for passed, want in (
        (("flash-varlen", "sdpa"), "flash-varlen"),
        (("sdpa",), "sdpa"),
        ((), None),
    ):
        monkeypatch.setitem(DENSE_PREFILL_CHOICES, key, passed)
        assert dense_prefill_impl(cuda, torch.bfloat16, 8, 2, 64) == want


def test_the_setting_forces_an_implementation_or_the_paged_kernel(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """settings.dense_prefill: a named implementation where its probe passed (else the paged
    kernel: None), "off" never dense, anything else refused."""
    from services.worker.attention.dense_prefill import set_dense_prefill

    cuda = torch.device("cuda")
    key = (str(cuda), str(torch.bfloat16), 8, 2, 64)
    try:
        monkeypatch.setitem(DENSE_PREFILL_CHOICES, key, ("flash-varlen", "sdpa"))
        set_dense_prefill("sdpa")
        assert dense_prefill_impl(cuda, torch.bfloat16, 8, 2, 64) == "sdpa"
        set_dense_prefill("off")
        assert dense_prefill_impl(cuda, torch.bfloat16, 8, 2, 64) is None
        assert _meta([1, 4, 6], [3, 4, 6]).dense_prefill is None  # no split is built
        monkeypatch.setitem(DENSE_PREFILL_CHOICES, key, ("flash-varlen",))
        set_dense_prefill("sdpa")
        assert dense_prefill_impl(cuda, torch.bfloat16, 8, 2, 64) is None
        with pytest.raises(ValueError, match="dense_prefill must be one of"):
            set_dense_prefill("cudnn")
    finally:
        set_dense_prefill("auto")
    assert dense_prefill_impl(cuda, torch.bfloat16, 8, 2, 64) == "flash-varlen"
