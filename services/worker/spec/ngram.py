"""Prompt lookup (n-gram) drafting: no weights, drafts copied from the request's own tokens.

The last n tokens (n from `max_n` down to `min_n`) are searched for earlier in the request
(prompt and outputs); at the most recent earlier occurrence, the K tokens that followed it are
the drafts. Copy-heavy answers (quoting, editing given code) accept most of them. The longest
n wins because a longer matched context predicts the continuation better; the most recent
occurrence wins because the text near the end is the likeliest to be copied next.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_spec_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n or num_spec_tokens < 1:
            raise ValueError(f"bad n-gram settings: k={num_spec_tokens}, n in [{min_n}, {max_n}]")
        self.k = num_spec_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default K) drafts following the latest earlier match of the suffix of
        `tokens`; empty when no n-gram of the suffix occurs earlier.

        One pass over the tokens finds every earlier occurrence of the last token; each is
        then extended backwards (at most max_n - 1 more comparisons over the few candidates),
        so a step's lookups cost O(length) each, not one window scan per n."""
        k = self.k if k is None else k
        length = len(tokens)
        if k <= 0 or length - 1 < self.min_n:
            return []
        # Candidate ends e < length - 1 of an earlier occurrence: tokens[e] == the last token.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        if not ends.size:
            return []
        matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched backwards from e
        alive = np.ones(ends.size, dtype=bool)
        for d in range(1, min(self.max_n, length - 1)):
            alive &= ends >= d
            alive[alive] = tokens[ends[alive] - d] == tokens[length - 1 - d]
            if not alive.any():
                break
            matched += alive
        n = min(int(matched.max()), self.max_n)
        if n < self.min_n:
            return []
        start = int(ends[matched >= n][-1]) + 1  # the most recent occurrence of the longest n
        return tokens[start : start + k].tolist()  # type: ignore[no-any-return]
