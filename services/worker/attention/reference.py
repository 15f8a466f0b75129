"""Paged attention, PyTorch reference path, for one flat batch of mixed prefill and decode.

KV cache of one layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 = K,
1 = V); token position p of a request lives in slot `block_table[p // block_size] * block_size
+ p % block_size` (see kv_cache.py).

The flat batch puts decode requests (one query token each) first, then prefill/extend chunks.
Decodes are computed together: their blocks are gathered in one indexing op into a
`[num_decodes, max_blocks * block_size]` window and masked past each sequence's length, so the
Python cost of a decode step does not grow with the batch. Prefill chunks run one SDPA per
sequence over exactly that sequence's tokens: no request is padded to the longest prompt. A
chunk with no cached prefix attends its own fresh K/V (causal); a chunk extending a cached
prefix reads the prefix back from the cache with an explicit causal-with-offset mask. With
`causal=False` (a drafter's non-causal query block, CONTRACTS "Non-causal draft blocks") every
query of a chunk sees all of the row's keys up to its sequence length: no mask at all.

Sliding windows (`sliding_window=W`): a query at position q attends to keys q - W < k <= q
(transformers' rule). Only the blocks holding such keys are gathered, starting at block
(first key) // block_size, so entries of the block table that fell out of the window (the
scheduler's null block 0) are never read, and a decode reads at most ceil(W / block_size) + 1
blocks however long the sequence is.

`AttentionMetadata` is built once per step on the host per KV cache group and shared by the
layers of that group.

With a `decode_kernel` (meshllm_kernels/attention/cpu_decode.py, the worker's default where a C++
compiler is present), the K/V write and the decode rows go through one C++ call that reads the
cache in place instead of the gather + SDPA below (not for sliding windows); prefill spans take
the same path as without it. The gather + SDPA code stays the reference the kernel is tested
against, and the path of machines without a compiler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from meshllm_kernels.attention.backends import AttentionBackend, register_backend

if TYPE_CHECKING:
    from meshllm_kernels.attention.cpu_decode import CpuDecodeAttention, DecodeStep


@register_backend
class ReferenceAttention(AttentionBackend):
    """What this path declares to the backend registry (meshllm_kernels/attention/backends.py):
    spans are causal unless the metadata is built with `causal=False` (non-causal draft blocks:
    every query sees the whole sequence), sliding windows are honoured, and K/V
    are copied into the cache as they are (`write_kv`), so an fp8 cache, which needs a scale to
    quantize with, is refused rather than filled with unscaled values."""

    name = "reference"
    supports_non_causal = True
    supports_sliding_window = True


def step_lengths(
    query_lens: np.ndarray, seq_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """(query_lens, seq_lens) as int64 arrays and the number of leading single-token rows.

    Every attention path treats exactly that leading run as its decode batch; a single-token
    request after the first multi-token one is a prefill span (see AttentionMetadata.build).
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    not_decode = np.flatnonzero(query_lens != 1)
    num_decodes = int(not_decode[0]) if not_decode.size else len(query_lens)
    return query_lens, seq_lens, num_decodes


@dataclass(frozen=True)
class PrefillSpan:
    """One prefill/extend chunk: flat rows [start, end) at positions [context_len, seq_len)."""

    start: int
    end: int
    context_len: int
    seq_len: int
    block_ids: torch.Tensor | None  # blocks holding keys [key_start, seq_len); context_len > 0
    mask: torch.Tensor | None  # [end - start, seq_len - key_start] bool (True = attend)
    key_start: int = 0  # first key position read (block-aligned; > 0 only with a window)
    causal: bool = True  # False: every query sees keys [key_start, seq_len) (no mask)


@dataclass(frozen=True)
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V is written
    num_decodes: int = 0  # flat rows [0, num_decodes) are single-token decodes
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_step: DecodeStep | None = None  # decodes in C++ (module docstring)

    @classmethod
    def build(
        cls,
        *,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        slot_mapping: np.ndarray,
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
        decode_kernel: CpuDecodeAttention | None = None,
        causal: bool = True,
    ) -> AttentionMetadata:
        """From per-request arrays in flat-batch order (decodes first for the fast path).

        `seq_lens[i]` counts the request's tokens up to and including this step's chunk;
        `block_tables[i]` holds at least ceil(seq_lens[i] / block_size) valid block ids.
        A single-token request placed after a prefill is treated as a prefill span (correct,
        only slower). With `sliding_window`, only entries from the window's first block on need
        to be valid. `decode_kernel` is kept only where it applies (decodes on CPU, no window).
        `causal=False`: each prefill span's queries see every key of their row (a single-token
        row sees all its keys either way); not with a window.
        """
        if not causal and sliding_window is not None:
            raise ValueError("non-causal attention over a sliding window is not supported")
        device = torch.device(device)
        query_lens, seq_lens, num_decodes = step_lengths(query_lens, seq_lens)
        slots = torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(device)
        decode_tables = decode_mask = decode_step = None
        if device.type != "cpu" or sliding_window is not None or not num_decodes:
            decode_kernel = None
        if num_decodes and sliding_window is not None:
            decode_tables, decode_mask = _window_decode(
                seq_lens[:num_decodes], block_tables[:num_decodes], block_size, sliding_window
            )
            decode_tables, decode_mask = decode_tables.to(device), decode_mask.to(device)
        elif num_decodes:
            d_lens = seq_lens[:num_decodes]
            max_blocks = int(-(-d_lens.max() // block_size))
            decode_tables = torch.from_numpy(
                np.ascontiguousarray(block_tables[:num_decodes, :max_blocks], dtype=np.int64)
            ).to(device)
            window = np.arange(max_blocks * block_size)
            if decode_kernel is not None:
                lens = torch.from_numpy(np.ascontiguousarray(d_lens))
                decode_step = decode_kernel.step(slots, decode_tables, lens)
            if (d_lens == max_blocks * block_size).all():
                decode_mask = None
            else:
                mask = window[None, :] < d_lens[:, None]
                decode_mask = torch.from_numpy(mask).to(device).view(num_decodes, 1, 1, -1)
        starts = np.concatenate(([0], np.cumsum(query_lens)))
        prefills = []
        for i in range(num_decodes, len(query_lens)):
            q_len, s_len = int(query_lens[i]), int(seq_lens[i])
            context = s_len - q_len
            block_ids = mask_t = None
            key_start = 0
            if context > 0:
                n_blocks = -(-s_len // block_size)
                first = 0
                if sliding_window is not None:
                    first = max(0, context - sliding_window + 1) // block_size
                key_start = first * block_size
                block_ids = torch.from_numpy(
                    np.ascontiguousarray(block_tables[i, first:n_blocks], dtype=np.int64)
                ).to(device)
                if causal:
                    mask = _causal_mask(context, q_len, key_start, s_len, sliding_window)
                    mask_t = torch.from_numpy(mask).to(device)
            elif sliding_window is not None and q_len > sliding_window:
                mask_t = torch.from_numpy(_causal_mask(0, q_len, 0, s_len, sliding_window))
                mask_t = mask_t.to(device)
            prefills.append(
                PrefillSpan(
                    int(starts[i]),
                    int(starts[i + 1]),
                    context,
                    s_len,
                    block_ids,
                    mask_t,
                    key_start,
                    causal,
                )
            )
        return cls(
            num_tokens=int(starts[-1]),
            slot_mapping=slots,
            num_decodes=num_decodes,
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_step=decode_step,
        )


def _causal_mask(
    context: int, q_len: int, key_start: int, seq_len: int, window: int | None
) -> np.ndarray:
    """[q_len, seq_len - key_start] bool: query context + i sees keys k <= context + i, and
    with a window only k > context + i - window."""
    q_pos = (context + np.arange(q_len))[:, None]
    k_pos = np.arange(key_start, seq_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _window_decode(
    seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables [n, B], mask [n, 1, 1, B * block_size]) of decodes over a window: row i
    reads its blocks from the one holding position seq_len - window on (B is the widest such
    range), and attends to keys in [seq_len - window, seq_len). Entries past a row's own range
    are clipped to its last table column and masked out."""
    first = np.maximum(seq_lens - window, 0) // block_size
    last = -(-seq_lens // block_size)
    width = int((last - first).max())
    index = first[:, None] + np.arange(width)[None, :]
    table = np.take_along_axis(
        block_tables, np.minimum(index, block_tables.shape[1] - 1), axis=1
    ).astype(np.int64)
    keys = (index[:, :, None] * block_size + np.arange(block_size)).reshape(len(seq_lens), -1)
    mask = (keys >= (seq_lens - window)[:, None]) & (keys < seq_lens[:, None])
    return (
        torch.from_numpy(np.ascontiguousarray(table)),
        torch.from_numpy(mask).view(len(seq_lens), 1, 1, -1),
    )


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [T, kv_heads, head_dim] into their slots (before anything reads them)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] of this step -> attention output [T, heads * d].

    Writes this step's K/V into the cache first, so a decode (or an extend chunk) sees its own
    token through the cache like every earlier one.
    """
    step = meta.decode_step
    parts: list[torch.Tensor] = []
    if step is not None and step.supports(q, kv_cache):
        parts.append(step(q, k, v, kv_cache, scale))
    else:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.num_decodes:
            parts.append(_decode(q[: meta.num_decodes], kv_cache, meta, scale, k.shape[1]))
    for span in meta.prefills:
        parts.append(_prefill(q, k, v, kv_cache, span, scale))
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=0)


def _gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[2, len(block_ids), block_size * kv_heads * head_dim]: whole blocks copied as rows.

    One index_select along dim 0 of the [2 * num_blocks, block] view (K rows, then the same
    blocks' V rows): a plain row copy, faster on CPU than selecting along dim 1 of a
    [2, num_blocks, block] view, and than advanced indexing."""
    num_blocks = kv_cache.shape[1]
    rows = torch.cat((block_ids, block_ids + num_blocks))
    return kv_cache.view(2 * num_blocks, -1).index_select(0, rows).view(2, len(block_ids), -1)


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_heads: int
) -> torch.Tensor:
    # GQA without repeating K/V: the query heads sharing one KV head become that head's
    # "query rows", so one SDPA call covers every decode of the batch.
    n, heads, head_dim = q.shape
    assert meta.decode_block_tables is not None
    kv = _gather_blocks(kv_cache, meta.decode_block_tables.view(-1))
    kv = kv.view(2, n, -1, kv_heads, head_dim).transpose(2, 3)  # [2, n, kv_heads, L, d]
    qg = q.view(n, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(n, heads * head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    if span.context_len == 0:
        ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
        vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            qs,
            ks,
            vs,
            attn_mask=span.mask,  # None (plain causal) unless a window cuts the chunk
            is_causal=span.causal and span.mask is None,
            scale=scale,
            enable_gqa=True,
        )
    else:
        assert span.block_ids is not None
        kv = _gather_blocks(kv_cache, span.block_ids)
        kv = kv.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
        kv = kv[:, : span.seq_len - span.key_start]
        ks, vs = kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(  # mask None: non-causal, every key
            qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True
        )
    n = span.end - span.start
    return out.squeeze(0).transpose(0, 1).reshape(n, -1)
