"""Paged attention over a flat mixed batch equals dense causal attention per sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.attention.reference import AttentionMetadata, paged_attention, write_kv

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 8


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, d] at the last n positions of k/v [L, KV, d]; plain softmax attention."""
    n, length = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * DIM**-0.5
    allowed = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())
    return out.reshape(n, HEADS * DIM).float()


class Sequence:
    """One request: full K/V history [length], of which `cached` positions are already in the
    cache, and `n` new ones computed this step."""

    def __init__(self, rng: np.random.Generator, blocks: list[int], cached: int, n: int) -> None:
        self.blocks, self.cached, self.n = blocks, cached, n
        length = cached + n
        assert len(blocks) * BLOCK >= length
        self.k = torch.randn(length, KV_HEADS, DIM)
        self.v = torch.randn(length, KV_HEADS, DIM)
        self.q = torch.randn(n, HEADS, DIM)

    def slots(self, positions: range) -> list[int]:
        return [self.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_dense_attention(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    cache = torch.zeros(2, 40, BLOCK, KV_HEADS, DIM, dtype=dtype)
    free = list(rng.permutation(40))  # scattered, non-contiguous block ids
    take = lambda count: [int(free.pop()) for _ in range(count)]  # noqa: E731
    seqs = [
        Sequence(rng, take(3), cached=9, n=1),  # decodes of different lengths
        Sequence(rng, take(1), cached=2, n=1),
        Sequence(rng, take(5), cached=16, n=1),  # decode exactly filling its blocks' start
        Sequence(rng, take(2), cached=0, n=7),  # fresh prefill
        Sequence(rng, take(4), cached=6, n=5),  # chunk extending a cached prefix
        Sequence(rng, take(2), cached=0, n=1),  # one-token prompt after a prefill
    ]
    for s in seqs:  # the earlier steps' K/V are already in the cache
        slots = torch.tensor(s.slots(range(s.cached)), dtype=torch.int64)
        write_kv(cache, s.k[: s.cached].to(dtype), s.v[: s.cached].to(dtype), slots)
    max_blocks = max(len(s.blocks) for s in seqs)
    tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
    for i, s in enumerate(seqs):
        tables[i, : len(s.blocks)] = s.blocks
    meta = AttentionMetadata.build(
        query_lens=np.array([s.n for s in seqs]),
        seq_lens=np.array([s.cached + s.n for s in seqs]),
        block_tables=tables,
        block_size=BLOCK,
        slot_mapping=np.concatenate([s.slots(range(s.cached, s.cached + s.n)) for s in seqs]),
    )
    assert meta.num_decodes == 3 and len(meta.prefills) == 3
    q = torch.cat([s.q for s in seqs]).to(dtype)
    k = torch.cat([s.k[s.cached :] for s in seqs]).to(dtype)
    v = torch.cat([s.v[s.cached :] for s in seqs]).to(dtype)
    out = paged_attention(q, k, v, cache, meta, DIM**-0.5)
    expected = torch.cat(
        [
            dense_reference(s.q.to(dtype).float(), s.k.to(dtype).float(), s.v.to(dtype).float())
            for s in seqs
        ]
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    # this step's K/V were written into their slots
    for s in seqs:
        slots = s.slots(range(s.cached + s.n))
        stored = cache.view(2, -1, KV_HEADS, DIM)[:, slots]
        torch.testing.assert_close(stored[0].float(), s.k.to(dtype).float(), rtol=0, atol=0)
        torch.testing.assert_close(stored[1].float(), s.v.to(dtype).float(), rtol=0, atol=0)


def test_decode_only_batch_needs_no_mask_when_blocks_are_full() -> None:
    meta = AttentionMetadata.build(
        query_lens=np.array([1, 1]),
        seq_lens=np.array([8, 8]),
        block_tables=np.array([[0, 1], [2, 3]]),
        block_size=BLOCK,
        slot_mapping=np.array([7, 15]),
    )
    assert meta.decode_mask is None and meta.prefills == []
    assert meta.decode_block_tables is not None
    assert meta.decode_block_tables.tolist() == [[0, 1], [2, 3]]


def test_padding_past_a_short_decode_is_masked_out() -> None:
    """A garbage-filled block beyond a sequence's length must not change its output."""
    torch.manual_seed(1)
    cache = torch.randn(2, 4, BLOCK, KV_HEADS, DIM)
    meta = AttentionMetadata.build(
        query_lens=np.array([1, 1]),
        seq_lens=np.array([2, 8]),
        block_tables=np.array([[0, 3], [1, 2]]),  # row 0 reads block 3 only as padding
        block_size=BLOCK,
        slot_mapping=np.array([1, 2 * BLOCK + 3]),
    )
    q = torch.randn(2, HEADS, DIM)
    k, v = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    first = paged_attention(q, k, v, cache, meta, DIM**-0.5)
    cache[:, 3] = 1e4
    second = paged_attention(q, k, v, cache, meta, DIM**-0.5)
    torch.testing.assert_close(first[0], second[0])


@pytest.mark.parametrize("cached", [8, 0])
def test_a_non_causal_block_sees_its_whole_sequence(cached: int) -> None:
    """CONTRACTS "Non-causal draft blocks" on the reference path: qlen=2 over seq_len=10,
    non-causal, row 0 sees all 10 positions (a path that ignores the flag sees 9), with the
    first 8 cached and without a cached prefix (a 10-token block)."""
    rng = np.random.default_rng(3)
    n = 10 - cached
    seq = Sequence(rng, [2, 0, 1], cached, n)
    cache = torch.zeros(2, 3, BLOCK, KV_HEADS, DIM)
    slots = torch.tensor(seq.slots(range(cached)), dtype=torch.int64)
    write_kv(cache, seq.k[:cached], seq.v[:cached], slots)

    def attend(causal: bool) -> torch.Tensor:
        meta = AttentionMetadata.build(
            query_lens=np.array([n]),
            seq_lens=np.array([10]),
            block_tables=np.array([seq.blocks]),
            block_size=BLOCK,
            slot_mapping=np.array(seq.slots(range(cached, 10))),
            causal=causal,
        )
        k, v = seq.k[cached:], seq.v[cached:]
        return paged_attention(seq.q, k, v, cache.clone(), meta, DIM**-0.5)

    every = dense_reference(seq.q[:1], seq.k, seq.v)  # a last query sees all 10
    causal = attend(True)
    torch.testing.assert_close(attend(False)[0], every[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(causal, dense_reference(seq.q, seq.k, seq.v), atol=1e-5, rtol=1e-5)
    assert (causal[0] - every[0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="sliding window"):
        AttentionMetadata.build(
            query_lens=np.array([n]), seq_lens=np.array([10]), block_tables=np.array([seq.blocks]),
            block_size=BLOCK, slot_mapping=np.arange(n), causal=False, sliding_window=4,
        )  # fmt: skip
