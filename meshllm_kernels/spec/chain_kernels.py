"""A chained verify step's own work in two launches (services/worker/spec/chain.py).

The PyTorch version of a chained step's proposal, layout and acceptance is some eighty small
operations; launching them from Python cost the host ~1.3 ms a step on the H100 machine, more
than the step's forward, so the chain ran slower than the host-side path it replaces. Here:

- `lay_out_`: one program per request finds its n-gram drafts (the longest suffix of n tokens,
  max_n down to min_n, ending earlier in the row; its most recent occurrence; device_ngram.py's
  rule), cuts them to the request's slots, max_tokens and max_model_len, and writes the step's
  padded rows (ids, positions, KV slots; the span's key count) straight into the verify graph's
  inputs, and the drafts for the acceptance;
- `accept_`: one program per request accepts its drafts up to the first draw that differs,
  writes the draws after the row's tokens, advances its length and newest token, and packs the
  result the host reads ([tokens emitted, drafts verified, draws...]).

`services/worker/spec/chain.py` holds the same steps in PyTorch (the CPU path and these
kernels' reference, tests/kernels/test_chain_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SEARCH_BLOCK = 256  # candidate ends compared per iteration of a program's search


@triton.jit
def _lay_out_kernel(
    tokens_ptr, tokens_stride, length_ptr, rows_ptr, slots_ptr, limits_ptr,
    tables_ptr, tables_stride, num_table_blocks,
    ids_ptr, positions_ptr, kv_slots_ptr, seq_lens_ptr,
    drafts_ptr, num_drafts_ptr, lengths_ptr, active_ptr,
    max_model_len, block_size,
    K: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    row_tokens = tokens_ptr + row * tokens_stride
    length = tl.load(length_ptr + row)
    slots = tl.load(slots_ptr + i)
    limit = tl.load(limits_ptr + i)
    last = tl.maximum(length - 1, 0)
    active = limit > length
    room = tl.minimum(tl.minimum(slots, limit - length - 1), max_model_len - 1 - length)

    # The longest match (at most MAX_N), then the latest end: max of matched * big + end.
    big = max_model_len + 2 * W + 2
    best = length * 0 - 1
    for start in range(0, last.to(tl.int32), BLOCK):
        ends = start + tl.arange(0, BLOCK)
        alive = ends < last
        matched = tl.zeros([BLOCK], dtype=tl.int64)
        for d in tl.static_range(MAX_N):
            ok = alive & (ends >= d)  # (so last - d > 0: ends < last)
            here = tl.load(row_tokens + ends - d, mask=ok, other=-1)
            suffix = tl.load(row_tokens + tl.maximum(last - d, 0))
            alive = ok & (here == suffix)
            matched += alive.to(tl.int64)
        score = tl.where(matched > 0, matched * big + ends, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    n = tl.where(best >= 0, best // big, 0)
    end = best % big
    found = (best >= 0) & (n >= MIN_N) & (last >= MIN_N) & active
    first = end + 1
    count = tl.minimum(tl.minimum(tl.maximum(room, 0), K), length - first)
    count = tl.where(found, tl.maximum(count, 0), 0)

    j = tl.arange(0, BLOCK_W)
    in_span = j < W
    is_draft = (j >= 1) & (j <= count)
    real = (j <= tl.where(active, count, -1)) & in_span  # (no scalar in a mask: interpreter)
    at = tl.where(j == 0, last, first + j - 1)
    ids = tl.load(row_tokens + at, mask=real, other=0).to(tl.int64)
    positions = last + tl.minimum(j, count)
    block = tl.minimum(positions // block_size, num_table_blocks - 1)
    table = tl.load(tables_ptr + i * tables_stride + block, mask=in_span, other=0).to(tl.int64)
    kv_slots = tl.where(real, table * block_size + positions % block_size, -1)
    out = i * W + j
    tl.store(ids_ptr + out, ids, mask=in_span)
    tl.store(positions_ptr + out, positions, mask=in_span)
    tl.store(kv_slots_ptr + out, kv_slots, mask=in_span)
    tl.store(seq_lens_ptr + i, (last + W).to(seq_lens_ptr.dtype.element_ty))
    # drafts: column j - 1 of this row (0 past its count)
    tl.store(drafts_ptr + i * K + j - 1, tl.where(is_draft, ids, 0), mask=(j >= 1) & in_span)
    tl.store(num_drafts_ptr + i, count)
    tl.store(lengths_ptr + i, length)
    tl.store(active_ptr + i, active.to(tl.int64))


@triton.jit
def _accept_kernel(
    tokens_ptr, tokens_stride, length_ptr, latest_ptr, rows_ptr, draws_ptr,
    drafts_ptr, num_drafts_ptr, lengths_ptr, active_ptr, packed_ptr,
    K: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    j = tl.arange(0, BLOCK_W)
    in_span = j < W
    draws = tl.load(draws_ptr + i * W + j, mask=in_span, other=0)
    num_drafts = tl.load(num_drafts_ptr + i)
    drafts = tl.load(drafts_ptr + i * K + j, mask=j < K, other=-1)
    match = (draws == drafts) & (j < num_drafts)
    accepted = tl.min(tl.where(match, BLOCK_W, j), axis=0)  # the first j that is no match
    length = tl.load(lengths_ptr + i)
    active = tl.load(active_ptr + i) != 0
    count = tl.where(active, accepted + 1, 0)
    tl.store(tokens_ptr + row * tokens_stride + length + j, draws.to(tl.int32), mask=in_span)
    tl.store(length_ptr + row, length + count)
    # latest[row] only for an active row: a pad request's row (a chained graph's scratch row)
    # is past `latest`. The mask is a block, as the interpreter needs.
    newest = tl.where(j == accepted, draws, 0)
    first = (j == 0) & ((j * 0 + active.to(tl.int32)) != 0)
    tl.store(latest_ptr + row + j * 0, tl.sum(newest, axis=0) + j * 0, mask=first)
    packed = packed_ptr + i * (W + 2)
    tl.store(packed, count.to(tl.int64))
    tl.store(packed + 1, num_drafts.to(tl.int64))
    tl.store(packed + 2 + j, draws, mask=in_span)


def lay_out_(
    tokens: torch.Tensor,
    length: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    limits: torch.Tensor,
    block_tables: torch.Tensor,
    out: dict[str, torch.Tensor],
    *,
    k: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
    block_size: int,
) -> None:
    """Propose and lay out R = len(rows) requests (module doc). tokens [N, C] int32, length
    [N] int64 (the device's rows); rows, slots, limits [R] int64; block_tables [R, B] (int32
    or int64, rows contiguous). `out`: input_ids, positions, slots [R (k + 1)] int64,
    seq_lens [R] (int32 or int64), drafts [R, k], num_drafts, lengths, active [R] int64, all
    written here. No host synchronization."""
    width = k + 1
    _lay_out_kernel[(len(rows),)](
        tokens, tokens.stride(0), length, rows, slots, limits,
        block_tables, block_tables.stride(0), block_tables.shape[1],
        out["input_ids"], out["positions"], out["slots"], out["seq_lens"],
        out["drafts"], out["num_drafts"], out["lengths"], out["active"],
        max_model_len, block_size,
        K=k, W=width, BLOCK_W=triton.next_power_of_2(width),
        MIN_N=min_n, MAX_N=max_n, BLOCK=SEARCH_BLOCK,
    )  # fmt: skip


def accept_(
    tokens: torch.Tensor,
    length: torch.Tensor,
    latest: torch.Tensor,
    rows: torch.Tensor,
    draws: torch.Tensor,
    step: dict[str, torch.Tensor],
    packed: torch.Tensor,
    *,
    k: int,
) -> None:
    """Accept R requests' drafts against their draws [R, k + 1] int64 (the lay_out_ outputs in
    `step`), update tokens, length and latest [N] int64 of their rows, and fill packed
    [R, k + 3] int64. No host synchronization."""
    width = k + 1
    _accept_kernel[(len(rows),)](
        tokens, tokens.stride(0), length, latest, rows, draws,
        step["drafts"], step["num_drafts"], step["lengths"], step["active"], packed,
        K=k, W=width, BLOCK_W=triton.next_power_of_2(width),
    )  # fmt: skip
