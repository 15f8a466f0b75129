"""Prompt lookup (n-gram) drafting: no weights, drafts copied from the request's own tokens.

The last n tokens (n from `max_n` down to `min_n`) are searched for earlier in the request
(prompt and outputs); at the most recent earlier occurrence, the K tokens that followed it are
the drafts. Copy-heavy answers (quoting, editing given code) accept most of them. The longest
n wins because a longer matched context predicts the continuation better; the most recent
occurrence wins because the text near the end is the likeliest to be copied next.

The search runs between a step's end and the next one's launch, on the host, for the whole
batch: in C++ (meshllm_kernels/spec/ngram_lookup.cpp, one pass per row) where a compiler built
it, else as a few NumPy array operations over the batch (at batch 16 inside a CPU engine's
step, 0.21-0.24 ms against C++'s 0.08-0.10, bench/RESULTS.md). Both give the same drafts.
"""

from __future__ import annotations

import logging

import numpy as np

from meshllm_kernels.runtime.cpu_library import KernelUnavailable
from meshllm_kernels.spec import ngram_lookup

log = logging.getLogger(__name__)


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4, native: bool = True) -> None:
        """`native`: search with the C++ library when it builds (else, or False: NumPy)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"bad n-gram settings: n in [{min_n}, {max_n}]")
        self.min_n = min_n
        self.max_n = max_n
        self.lookup: ngram_lookup.NgramLookup | None = None
        if native:
            try:
                self.lookup = ngram_lookup.load()
            except KernelUnavailable as exc:
                log.warning("n-gram search in NumPy: %s", exc)

    def propose(
        self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray, ks: np.ndarray
    ) -> list[list[int]]:
        """Drafts for each row i of a batch: up to `ks[i]` tokens (0: none) following the
        latest earlier match of the suffix of `token_ids[rows[i], :lengths[i]]` (int32),
        empty when no n-gram of the suffix occurs earlier."""
        if self.lookup is None:
            return self.propose_numpy(token_ids, rows, lengths, ks)
        starts, counts = self.lookup(token_ids, rows, lengths, ks, self.min_n, self.max_n)
        return [
            token_ids[row, start : start + count].tolist() if count else []
            for row, start, count in zip(
                rows.tolist(), starts.tolist(), counts.tolist(), strict=True
            )
        ]

    def propose_numpy(
        self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray, ks: np.ndarray
    ) -> list[list[int]]:
        """`propose` in NumPy. One comparison over the rows finds every earlier occurrence
        (row, end e) of each row's last token; each is then extended backwards (at most
        max_n - 1 more comparisons over the few candidates of all rows together), so a step's
        lookups cost a few array operations for the whole batch, not a dozen per request."""
        num_rows = len(lengths)
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        lengths = lengths.astype(np.int64)
        live = (ks > 0) & (lengths - 1 >= self.min_n)
        if not live.any():
            return drafts
        width = int(lengths[live].max())
        tokens = token_ids[rows, :width]  # rows not live are masked below
        last_pos = np.where(live, lengths - 1, 0)  # 0 for rows not live: no position before
        last = tokens[np.arange(num_rows), last_pos]
        before_last = np.arange(width)[None, :] < last_pos[:, None]
        # Candidate ends e < length - 1 of an earlier occurrence: tokens[e] == the last token.
        row, end = np.nonzero((tokens == last[:, None]) & before_last)  # row-major: e rises
        if not row.size:
            return drafts
        row_last = last_pos[row]
        matched = np.ones(row.size, dtype=np.int64)  # suffix tokens matched backwards from e
        alive = np.ones(row.size, dtype=bool)
        for d in range(1, self.max_n):
            alive &= end >= d  # (so d <= end < length - 1)
            at = np.flatnonzero(alive)
            if not at.size:
                break
            alive[at] = tokens[row[at], end[at] - d] == tokens[row[at], row_last[at] - d]
            matched += alive
        firsts = np.flatnonzero(np.diff(row, prepend=-1))  # each row's first candidate
        rows_with = row[firsts]
        n = np.minimum(np.maximum.reduceat(matched, firsts), self.max_n)
        qualifies = matched >= np.repeat(n, np.diff(np.append(firsts, row.size)))
        latest = np.maximum.reduceat(np.where(qualifies, np.arange(row.size), -1), firsts)
        for r, n_r, at in zip(rows_with.tolist(), n.tolist(), latest.tolist(), strict=True):
            if n_r >= self.min_n:
                start = int(end[at]) + 1  # the most recent occurrence of the longest n
                stop = min(start + int(ks[r]), int(lengths[r]))
                drafts[r] = tokens[r, start:stop].tolist()
        return drafts
