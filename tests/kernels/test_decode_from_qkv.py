"""Decode attention from the qkv partials: bit-identical to the three launches it replaces
(split-K reduce, RoPE + KV insert, strided split-K decode), and close to the reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from meshllm_kernels.attention.kv_insert import insert_qkv
from meshllm_kernels.attention.paged_decode import paged_decode_attention
from meshllm_kernels.decode_chain.decode_from_qkv import decode_from_qkv, decode_from_qkv_reference
from meshllm_kernels.decode_chain.gemv import GemvConfig, gemv, gemv_partials
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3
from tests.kernels.paged_batch import make_paged_batch, tolerance
from tests.kernels.rope_cache import cos_sin_cache

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 8, 2, 32, 64
WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM


@dataclass
class Step:
    x: torch.Tensor  # [B, HIDDEN] the normed hidden states
    weight: torch.Tensor  # [WIDTH, HIDDEN] the qkv projection
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor
    rope_rows: torch.Tensor
    table: torch.Tensor
    scales: dict[str, torch.Tensor]


def _step(device, dtype, seq_lens, *, rotary_dim=HEAD_DIM, cache_dtype=None, skip_row=None):  # type: ignore[no-untyped-def]
    batch = make_paged_batch(
        seq_lens, [1] * len(seq_lens), num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, page=16, dtype=dtype, device=device, cache_dtype=cache_dtype,
        per_head_scale=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(seq_lens), HIDDEN, generator=gen).to(dtype).to(device)
    weight = (torch.randn(WIDTH, HIDDEN, generator=gen) * 0.2).to(dtype).to(device)
    last = batch.seq_lens.long() - 1  # the new token: each sequence's last key
    blocks = batch.block_tables.gather(1, (last // 16)[:, None]).squeeze(1).long()
    slots = blocks * 16 + last % 16
    if skip_row is not None:  # graph padding: a row whose token is not written
        slots[skip_row] = -1
    table = cos_sin_cache(int(last.max()) + 1, rotary_dim, device).to(dtype)
    return Step(
        x, weight, batch.kv_cache, batch.block_tables, batch.seq_lens, slots, last, table,
        batch.scales,
    )  # fmt: skip


def _three_launches(s: Step, config: GemvConfig, num_splits: int, is_neox: bool):  # type: ignore[no-untyped-def]
    cache = s.kv_cache.clone()
    qkv = gemv(s.x, s.weight, config)
    b = qkv.shape[0]
    q = qkv[:, : HEADS * HEAD_DIM].view(b, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(b, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(b, KV_HEADS, HEAD_DIM)
    q_rot = insert_qkv(q, k, v, cache, s.slots, s.rope_rows, s.table, is_neox=is_neox, **s.scales)
    out = paged_decode_attention(
        q_rot, cache, s.block_tables, s.seq_lens, num_splits=num_splits, strided=True,
        **s.scales,
    )  # fmt: skip
    return out, cache, qkv


def _fused(s: Step, config: GemvConfig, num_splits: int, is_neox: bool):  # type: ignore[no-untyped-def]
    cache = s.kv_cache.clone()
    part = gemv_partials(s.x, s.weight, config)
    assert part.shape[0] == config.split_k
    out = decode_from_qkv(
        part, cache, s.block_tables, s.seq_lens, s.slots, s.rope_rows, s.table,
        num_heads=HEADS, num_splits=num_splits, dtype=s.x.dtype, is_neox=is_neox, **s.scales,
    )  # fmt: skip
    return out, cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    ("dtype", "split_k", "num_splits", "is_neox", "rotary_dim"),
    [
        (torch.bfloat16, 2, 3, True, HEAD_DIM),  # split-K partials summed; uneven pieces
        (torch.float16, 1, 16, False, HEAD_DIM),  # one partial; gpt-j; many empty pieces
        (torch.bfloat16, 4, 5, True, 16),  # partial rotary: dims past 16 pass through
        (torch.float32, 2, 3, True, HEAD_DIM),
    ],
)
def test_bit_identical_to_the_three_launches(
    device, dtype, split_k, num_splits, is_neox, rotary_dim
) -> None:  # type: ignore[no-untyped-def]
    # 1 key (the new token alone), a tile edge (64), a long ragged one; row 3 is padding.
    s = _step(device, dtype, [1, 64, 150, 37], rotary_dim=rotary_dim, skip_row=3)
    config = GemvConfig(block_n=32, block_k=16, split_k=split_k)
    want, want_cache, qkv = _three_launches(s, config, num_splits, is_neox)
    got, got_cache = _fused(s, config, num_splits, is_neox)
    assert not torch.equal(want_cache, s.kv_cache), "the new tokens were never written"
    assert torch.equal(_bits(got_cache), _bits(want_cache)), "cache bytes differ"
    assert torch.equal(_bits(got), _bits(want)), "attention output differs"
    ref_cache = s.kv_cache.clone()
    ref = decode_from_qkv_reference(
        qkv, ref_cache, s.block_tables, s.seq_lens, s.slots, s.rope_rows, s.table,
        num_heads=HEADS, is_neox=is_neox,
    )  # fmt: skip
    torch.testing.assert_close(got.float(), ref.float(), atol=tolerance(dtype), rtol=0)


@pytest.mark.parametrize("num_splits", [3, 16])
def test_fp8_cache_with_per_head_scales(device, num_splits) -> None:  # type: ignore[no-untyped-def]
    s = _step(device, torch.bfloat16, [5, 150, 33], cache_dtype=FP8_E4M3)
    config = GemvConfig(block_n=32, block_k=16, split_k=2)
    want, want_cache, _ = _three_launches(s, config, num_splits, True)
    got, got_cache = _fused(s, config, num_splits, True)
    assert torch.equal(_bits(got_cache), _bits(want_cache)), "fp8 cache bytes differ"
    assert torch.equal(_bits(got), _bits(want))


def test_the_new_token_is_attended(device) -> None:  # type: ignore[no-untyped-def]
    """A one-key sequence attends only to its new token: the output is that token's V."""
    s = _step(device, torch.float32, [1, 1])
    config = GemvConfig(block_n=32, block_k=16, split_k=2)
    out, _ = _fused(s, config, 4, True)
    qkv = s.x @ s.weight.t()
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(2, KV_HEADS, 1, HEAD_DIM)
    want = v.expand(2, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).reshape(2, HEADS, HEAD_DIM)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_input_errors(device) -> None:  # type: ignore[no-untyped-def]
    s = _step(device, torch.bfloat16, [5, 20])
    part = gemv_partials(s.x, s.weight, GemvConfig(block_n=32, block_k=16, split_k=2))

    def call(**kw):  # type: ignore[no-untyped-def]
        args = dict(
            qkv_partials=part, kv_cache=s.kv_cache, block_tables=s.block_tables,
            seq_lens=s.seq_lens, slot_mapping=s.slots, rope_rows=s.rope_rows,
            cos_sin_cache=s.table, num_heads=HEADS, num_splits=4, dtype=torch.bfloat16,
        )  # fmt: skip
        args.update(kw)
        return decode_from_qkv(**args)

    with pytest.raises(TypeError, match="qkv_partials has dtype"):
        call(qkv_partials=part.to(torch.bfloat16))
    with pytest.raises(ValueError, match="qkv_partials width"):
        call(qkv_partials=part[:, :, :-HEAD_DIM].contiguous())
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(num_heads=3)
    with pytest.raises(ValueError, match="num_splits must be in 2"):
        call(num_splits=1)
    with pytest.raises(ValueError, match=r"slot_mapping has shape \(1,\)"):
        call(slot_mapping=s.slots[:1])
    with pytest.raises(TypeError, match="dtype must be one of"):
        call(dtype=torch.int8)
    with pytest.raises(ValueError, match="cos_sin_cache width"):
        call(cos_sin_cache=s.table[:, :3])
    with pytest.raises(ValueError, match="seq_lens has 1 entries"):
        call(seq_lens=s.seq_lens[:1])
    if device.type == "cpu":  # checked on the host only where reading them back is free
        with pytest.raises(ValueError, match="rope_rows must lie"):
            call(rope_rows=s.rope_rows + 1000)
        with pytest.raises(ValueError, match="seq_lens must lie"):
            call(seq_lens=torch.zeros_like(s.seq_lens))
