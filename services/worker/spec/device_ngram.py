"""Prompt lookup on the device: the n-gram drafts of ngram.py as a few tensor operations.

The same rule as NgramProposer (the longest suffix of n tokens, n from max_n down to min_n,
found ending earlier in the row; its most recent occurrence; the tokens after it, up to the
row's room and its last token), computed for a whole batch without reading anything back to
the host: a chained verify step (chain.py) proposes its drafts from tokens the previous step
wrote on the device, before the host has seen them.

Every row compares its last n tokens against each earlier end e at once ([R, W] booleans per
n), so the cost grows with the width W of the token window the caller passes (the longest row
it may hold), not with the number of occurrences.
"""

from __future__ import annotations

import torch


def ngram_drafts(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    room: torch.Tensor,
    k: int,
    min_n: int,
    max_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [R, k] int64, counts [R] int64) for rows `tokens` [R, W] whose first
    `lengths[r]` tokens are the request's: up to min(k, room[r]) tokens (count 0: none; drafts
    past a row's count are 0). `lengths` <= W. No host synchronization."""
    num_rows, width = tokens.shape
    device = tokens.device
    lengths = lengths.to(torch.int64)
    last = lengths - 1  # the suffix ends here; earlier ends e < last are the candidates
    ends = torch.arange(width, device=device)
    alive = ends[None, :] < last[:, None]
    matched = torch.zeros(num_rows, width, dtype=torch.int64, device=device)
    rows = torch.arange(num_rows, device=device)
    for d in range(max_n):
        # tokens[e - d] against tokens[last - d], for every end e >= d
        shifted = tokens if d == 0 else torch.nn.functional.pad(tokens, (d, 0))[:, :width]
        suffix = tokens[rows, (last - d).clamp(min=0)]
        alive = alive & (ends[None, :] >= d) & (shifted == suffix[:, None])
        matched += alive
    best = matched.max(dim=1).values  # the longest n matched (at most max_n)
    latest = torch.where(
        (matched >= best[:, None]) & (matched > 0), ends[None, :], torch.full_like(ends, -1)
    ).amax(dim=1)  # the most recent end of the longest
    start = latest + 1
    found = (best >= min_n) & (last >= min_n) & (latest >= 0)
    counts = torch.minimum(room.to(torch.int64).clamp(min=0, max=k), lengths - start)
    counts = torch.where(found, counts.clamp(min=0), torch.zeros_like(counts))
    offsets = torch.arange(k, device=device)
    at = (start[:, None] + offsets[None, :]).clamp(0, width - 1)
    drafts = tokens.gather(1, at).to(torch.int64)
    drafts = torch.where(offsets[None, :] < counts[:, None], drafts, torch.zeros_like(drafts))
    return drafts, counts
