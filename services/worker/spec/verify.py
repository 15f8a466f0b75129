"""The acceptance rules: which drafts a verification keeps, and the token that follows them.

Row j of a request's verification (j = 0..k) holds the target's distribution p_j for the token
at position T + j after the prefix [verified tokens, d_1..d_j]: same logits as plain decoding
(the forward is causal), same transforms and grammar row. Two rules, chosen per request:

**Same noise** (`num_accepted`, `accepted_tokens`), for drafts that are point masses (n-gram
drafts at any temperature, every drafter's greedy drafts) and as the fallback for any draft
whose distribution the worker does not hold. Row j draws s_j exactly as plain decoding would
at T + j (same Gumbel noise, keyed by seed and position: CONTRACTS.md); drafts are kept while
d_j == s_j, then s_{a+1} is emitted (the correction, or the bonus when every draft stood). The
emitted tokens ARE the plain draws, so the output is the target's sequence token for token: at
temperature 0 this is exact-match greedy verification; at temperature > 0 with a point-mass
draft d it is rejection sampling (accept with P(s = d) = p(d) = min(1, p(d)/1); on rejection s
is p conditioned on s != d, the normalised residual max(0, p - δ_d)), and a seeded request
generates the very tokens it would without speculation. It stays exact for any draft chosen
independently of the target's noise, but accepts a sampled draft x only with probability
Σ q(x)p(x) instead of Σ min(p(x), q(x)).

**Rejection sampling** (`accept_mask`, `residual_scores`, `chain_tokens`), for drafts drawn at
temperature > 0 from a known q (the model drafters, draws.py): draft x_j is accepted iff
u_j · q_j(x_j) < p_j(x_j), u_j the counter RNG's uniform for (seed, T + j, x_j) in its own
position range; the first rejection emits a draw from the normalised residual max(0, p_j - q_j)
with the target's noise at T + j; when every draft stands, the bonus is the plain draw from
p_k. Each emitted token is then distributed exactly as p (Leviathan et al. 2023, Chen et al.
2023), and every random number is keyed by (seed, position), so a seeded request's output is
reproducible and does not depend on the rest of the batch. It is not the output plain
decoding would give for that seed (the draws differ), which is why point-mass drafts keep the
same-noise rule: there it costs nothing and preserves that stronger property.

A residual with no mass (p <= q everywhere, only possible through float rounding, or a row the
grammar left without a finite score) falls back to the plain draw s_j.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Same noise: how many leading drafts equal the target's draws (`sampled` has
    len(drafts) + 1 rows)."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return j
    return len(drafts)


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """Same noise: the step's output, the accepted drafts, then the correction or bonus."""
    a = num_accepted(drafts, sampled)
    return [int(t) for t in sampled[: a + 1]]


def accept_mask(
    p: torch.Tensor, q: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Rejection sampling: bool [M], draft m accepted (u · q(x) < p(x)). p, q [M, V] float32
    (target and draft distributions of each checked row), draft_ids [M], uniforms [M]."""
    index = draft_ids.to(torch.int64).unsqueeze(1)
    p_x = p.gather(1, index).squeeze(1)
    q_x = q.gather(1, index).squeeze(1)
    return uniforms * q_x < p_x


def residual_scores(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log max(0, p - q) [M, V], has_mass bool [M]): Gumbel-max over the scores draws from
    the normalised residual (no normalisation needed: argmax is shift-invariant)."""
    residual = (p.nan_to_num(0.0) - q).clamp_min_(0.0)
    return residual.log(), (residual > 0).any(dim=1)


def chain_tokens(
    drafts: Sequence[int],
    accepted: Sequence[bool],
    corrections: Sequence[int],
    bonus: int,
    extra: int | None = None,
) -> list[int]:
    """Rejection sampling: the step's output for one request. `accepted[j]` / `corrections[j]`
    for row j = 0..len(drafts) - 1, and for row len(drafts) too when `extra` (the proposal's
    next draft past the plan's, proposals.py) is checked there: accepted, it ends the output
    (no row holds the logits after it); rejected, its correction does. Without `extra` an
    all-accepted chain ends with `bonus`, the plain draw of the last row."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        if not accepted[j]:
            return [*out, int(corrections[j])]
        out.append(int(draft))
    if extra is None:
        return [*out, int(bonus)]
    n = len(drafts)
    return [*out, int(extra) if accepted[n] else int(corrections[n])]
