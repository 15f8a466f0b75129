"""Prompt logprobs of one request, gathered from the worker's steps into its first delta.

The worker sends, with a sampled token, the logprobs of the prompt positions it computed since
the request's previous one (services/worker/runner/prompt_logprobs.py); entry j of a
SampledTokens is position `prompt_logprobs_start + j`, whose value is the logprob of prompt
token `start + j + 1`. They are placed by position, so a recompute (preemption, a failed step)
overwrites what it computes again and the reply never depends on the path. The first delta
(start_index 0) carries one entry per prompt token after the first, in order; a delta whose
entries are incomplete gets none (the gateway then fails the choice rather than misalign it).
"""

from __future__ import annotations

from shared.protocol import RequestDelta, SampledTokens


class PromptLogprobsRecord:
    __slots__ = ("_logprobs", "_ranks", "_top", "k", "sent")

    def __init__(self, k: int, num_prompt_tokens: int) -> None:
        self.k = k
        self.sent = False
        n = max(num_prompt_tokens - 1, 0)
        self._logprobs: list[float | None] = [None] * n
        self._ranks: list[int] = [0] * n  # 0: the worker sent none
        self._top: list[tuple[list[int], list[float]] | None] = [None] * n

    def record(self, sampled: SampledTokens) -> None:
        values = sampled.prompt_logprobs
        if self.sent or not values:
            return
        ids, top = sampled.prompt_top_token_ids or [], sampled.prompt_top_logprobs or []
        ranks = sampled.prompt_ranks or []
        k = self.k
        if k and (len(ids) != len(values) * k or len(top) != len(ids)):
            return  # malformed: leave the positions empty
        if ranks and len(ranks) != len(values):
            return
        for j, value in enumerate(values):
            pos = sampled.prompt_logprobs_start + j
            if not 0 <= pos < len(self._logprobs):
                return
            self._logprobs[pos] = value
            self._ranks[pos] = ranks[j] if ranks else 0
            self._top[pos] = (ids[j * k : (j + 1) * k], top[j * k : (j + 1) * k]) if k else None

    def attach(self, delta: RequestDelta) -> None:
        if self.sent or delta.start_index != 0 or any(v is None for v in self._logprobs):
            return
        delta.prompt_logprobs = [v for v in self._logprobs if v is not None]
        if all(self._ranks):
            delta.prompt_ranks = self._ranks
        if self.k:
            delta.prompt_top_token_ids = [t for row in self._top if row for t in row[0]]
            delta.prompt_top_logprobs = [v for row in self._top if row for v in row[1]]
        self.sent = True
        self._logprobs, self._ranks, self._top = [], [], []
