"""The acceptance rule: keep drafts while they equal the target's own draw at their position.

Row j of a request's verification (j = 0..k) is sampled exactly as plain decoding would sample
the token at position T + j after the prefix [verified tokens, d_1..d_j]: same logits (the
forward is causal), same transforms and grammar row, same Gumbel noise (keyed by seed and
position, CONTRACTS.md), so the same token. Accepting d_1..d_a while d_j == s_j and then
emitting s_{a+1} (the correction, or the bonus when every draft stood) therefore reproduces the
target's own sequence token for token:

- at temperature 0 this is exactly greedy (accept while draft == argmax, then the argmax);
- at temperature > 0 with a deterministic drafter (n-gram: a point-mass draft distribution
  q = δ_d) it *is* rejection sampling: d is accepted with probability P(s = d) = p(d) =
  min(1, p(d)/q(d)), and on rejection s is a draw from p conditioned on s != d, i.e. the
  residual max(0, p - q) renormalised. The output distribution is the target's exactly, and a
  seeded request generates the very tokens it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafts equal the target's draws (`sampled` has len(drafts) + 1 rows)."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return j
    return len(drafts)


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The step's output: the accepted drafts, then the correction or bonus token."""
    a = num_accepted(drafts, sampled)
    return [int(t) for t in sampled[: a + 1]]
