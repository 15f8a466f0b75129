"""Every input error of the attention launchers raises a clear error before any launch."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention.paged_decode import paged_decode_attention
from meshllm_kernels.attention.paged_prefill import paged_prefill_attention
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3
from tests.kernels.paged_batch import PagedBatch, make_paged_batch


@pytest.fixture
def batch() -> PagedBatch:
    return make_paged_batch(
        [10, 6], [4, 6], num_heads=4, num_kv_heads=2, head_dim=16, page=4,
        dtype=torch.float16, device=torch.device("cpu"),
    )  # fmt: skip


def _prefill(b: PagedBatch, **over: object) -> None:
    args = {
        "q": b.q, "kv_cache": b.kv_cache, "block_tables": b.block_tables,
        "cu_seqlens_q": b.cu_seqlens_q, "seq_lens": b.seq_lens,
    }  # fmt: skip
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    paged_prefill_attention(**args, **kw)  # type: ignore[arg-type]


def _decode(b: PagedBatch, **over: object) -> None:
    args = {
        "q": b.q[:2], "kv_cache": b.kv_cache, "block_tables": b.block_tables,
        "seq_lens": b.seq_lens,
    }  # fmt: skip
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    paged_decode_attention(**args, **kw)  # type: ignore[arg-type]


CASES = [
    (TypeError, "q has dtype torch.int64", lambda b: {"q": b.q.long()}),
    (TypeError, "unsupported kv_cache dtype", lambda b: {"kv_cache": b.kv_cache.to(torch.int8)}),
    (ValueError, "kv_cache must have 5 dimensions", lambda b: {"kv_cache": b.kv_cache[0]}),
    (ValueError, "K and V planes", lambda b: {"kv_cache": b.kv_cache.repeat(2, 1, 1, 1, 1)}),
    (
        ValueError,
        "token records must be contiguous",
        lambda b: {"kv_cache": b.kv_cache.transpose(3, 4)},
    ),
    (ValueError, "head_dim 8 != kv_cache head_dim 16", lambda b: {"q": b.q[..., :8]}),
    (ValueError, "multiple of kv heads", lambda b: {"q": b.q[:, :3]}),
    (
        TypeError,
        "block_tables has dtype torch.int64",
        lambda b: {"block_tables": b.block_tables.long()},
    ),
    (ValueError, "block_tables has 1 rows", lambda b: {"block_tables": b.block_tables[:1]}),
    (TypeError, "seq_lens has dtype torch.int64", lambda b: {"seq_lens": b.seq_lens.long()}),
    (ValueError, "is on meta", lambda b: {"seq_lens": b.seq_lens.to("meta")}),
    (ValueError, "sliding_window must be positive", lambda b: {"sliding_window": 0}),
    (TypeError, "sliding_window must be an int", lambda b: {"sliding_window": 2.5}),
    (ValueError, "only for an fp8 kv_cache", lambda b: {"k_scale": 0.1, "v_scale": 0.1}),
    (ValueError, "needs k_scale and v_scale", lambda b: {"kv_cache": b.kv_cache.to(FP8_E4M3)}),
    (
        ValueError,
        "k_scale must be a scalar or a contiguous [num_kv_heads=2]",
        lambda b: {
            "kv_cache": b.kv_cache.to(FP8_E4M3),
            "k_scale": torch.ones(3),
            "v_scale": torch.ones(2),
        },
    ),
    (
        TypeError,
        "k_scale has dtype torch.float16",
        lambda b: {
            "kv_cache": b.kv_cache.to(FP8_E4M3),
            "k_scale": torch.ones(2, dtype=torch.float16),
            "v_scale": torch.ones(2),
        },
    ),
    (ValueError, "seq_len", lambda b: {"seq_lens": torch.tensor([10, 99], dtype=torch.int32)}),
]


@pytest.mark.parametrize(("exc", "message", "override"), CASES)
def test_prefill_rejects(batch: PagedBatch, exc, message, override) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("]", r"\]")):
        _prefill(batch, **override(batch))


@pytest.mark.parametrize(("exc", "message", "override"), CASES)
def test_decode_rejects(batch: PagedBatch, exc, message, override) -> None:  # type: ignore[no-untyped-def]
    over = override(batch)
    if "q" in over:
        over["q"] = over["q"][:2]
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("]", r"\]")):
        _decode(batch, **over)


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        ([0, 4, 9], "end at the token count 10"),
        ([1, 4, 10], "start at 0"),
        ([0, 1, 10], "seq_len >= qlen"),
        ([0, 11, 10], "non-decreasing"),
    ],
)
def test_prefill_rejects_inconsistent_lengths(batch: PagedBatch, cu, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        _prefill(batch, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))


def test_prefill_rejects_int64_cu_seqlens(batch: PagedBatch) -> None:
    with pytest.raises(TypeError, match=r"cu_seqlens_q has dtype torch\.int64"):
        _prefill(batch, cu_seqlens_q=batch.cu_seqlens_q.long())


def test_decode_rejects_bad_split_count(batch: PagedBatch) -> None:
    with pytest.raises(ValueError, match=r"num_splits must be in 1\.\.64"):
        _decode(batch, num_splits=0)
