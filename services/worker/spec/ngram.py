"""Prompt lookup (n-gram) drafting: no weights, drafts copied from the request's own tokens.

The last n tokens (n from `max_n` down to `min_n`) are searched for earlier in the request
(prompt and outputs); at the most recent earlier occurrence, the K tokens that followed it are
the drafts. Copy-heavy answers (quoting, editing given code) accept most of them. The longest
n wins because a longer matched context predicts the continuation better; the most recent
occurrence wins because the text near the end is the likeliest to be copied next.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_spec_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n or num_spec_tokens < 1:
            raise ValueError(f"bad n-gram settings: k={num_spec_tokens}, n in [{min_n}, {max_n}]")
        self.k = num_spec_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default K) drafts following the latest earlier match of the suffix of
        `tokens`; empty when no n-gram of the suffix occurs earlier."""
        k = self.k if k is None else k
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length-n-1: every occurrence except the suffix itself.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()  # type: ignore[no-any-return]
        return []
