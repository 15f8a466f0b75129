"""Logits processing before the Gumbel-max draw, vectorized over the batch.

The order is vLLM v1's, because users expect its results for the same parameters:

1. grammar bitmask (vLLM's model runner applies it before the sampler sees the logits);
2. allowed_token_ids: every other token -inf;
3. bad_token_ids and bad_words: -inf; a bad word's last token only while its other tokens are
   the latest outputs (bad_words.py);
4. min_tokens: eos and stop ids -inf while fewer than min_tokens outputs exist;
5. logit_bias: added;
6. penalties: repetition (prompt and output tokens: positive logits divided by it, others
   multiplied), then frequency (times the output count) and presence (once per seen output
   token) subtracted, as OpenAI defines them;
   — greedy rows (T == 0) take the argmax here —
7. temperature, then the truncations, computed on logits / T: min_p (tokens below
   min_p · max probability), top_k (tokens below the k-th largest logit; ties kept), top_p
   (the smallest top set whose mass reaches p; at least one token kept).

Masks are idempotent and commute with each other, so only the position of the value changes
(bias, penalties) and of the truncations (which see a distribution) matters. Truncations only
set -inf, so they are applied to the unscaled logits; the scaling itself happens inside the
draw (logits · 1/T + g), which keeps T in one place. Every function takes per-row parameter
tensors already gathered for the batch and keeps neutral parameters exact identities (a row
with no penalty comes out bit-identical), so one vectorized call serves mixed batches.
"""

from __future__ import annotations

import torch

from services.worker.sampling.row_tokens import BatchEntries

NEG_INF = float("-inf")


def mask_entries(logits: torch.Tensor, entries: BatchEntries) -> None:
    """Set the listed (batch row, token) logits to -inf, in place. `logits` has the batch's
    rows and a scratch row after them (row_tokens.py), as has every by-entry stage's."""
    if len(entries):
        neg_inf = torch.full((), NEG_INF, dtype=logits.dtype, device=logits.device)
        logits.index_put_((entries.batch_idx, entries.token_ids), neg_inf)


def keep_only_entries(
    logits: torch.Tensor, restricted: torch.Tensor, entries: BatchEntries
) -> None:
    """For rows where `restricted` [B] is True, -inf every token not listed; in place
    (`logits` [B + 1, V]: the scratch row last)."""
    keep = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
    keep[:-1] = ~restricted.unsqueeze(1)
    keep[-1:].fill_(True)
    listed = torch.ones((), dtype=torch.bool, device=logits.device)
    keep.index_put_((entries.batch_idx, entries.token_ids), listed)
    logits.masked_fill_(~keep, NEG_INF)


def add_entries(logits: torch.Tensor, entries: BatchEntries) -> None:
    """Add each entry's value to its logit (logit_bias), in place (`logits` [B + 1, V])."""
    if len(entries):
        logits.index_put_((entries.batch_idx, entries.token_ids), entries.values, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties; [B, V] in, new [B, V] out.

    prompt_mask: bool [B, V], token occurs in the prompt; output_counts: int [B, V].
    """
    counts = output_counts.to(logits.dtype)
    in_output = output_counts > 0
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | in_output, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * in_output.to(logits.dtype)


def truncation_mask(
    scaled: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """bool [B, V] of tokens removed by min_p, then top_k, then top_p, from logits / T.

    min_p: float [B] (0 = off); top_k: int64 [B] (>= V = off); top_p: float [B] (1 = off).
    `max_top_k` bounds top_k over the batch when known on the host (saves a device sync).
    Each stage sees the survivors of the previous one, as in vLLM v1.
    """
    removed = torch.zeros_like(scaled, dtype=torch.bool)
    if min_p is not None:
        probs = torch.softmax(scaled, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        removed |= probs < threshold
        scaled = scaled.masked_fill(removed, NEG_INF)
    if top_p is None:
        if top_k is not None:
            removed |= _below_top_k(scaled, top_k, max_top_k)
        return removed
    ordered, order = scaled.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = ordered.gather(1, (top_k.clamp(1, scaled.shape[1]) - 1).unsqueeze(1))
        ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    # Mass strictly before each token (descending); a token is kept while that is below p, so
    # the first token always survives and the kept set is the smallest reaching p (vLLM's
    # ascending "cumsum <= 1 - p" rule, read from the other end). p = 1 keeps everything even
    # where float cumsums overshoot 1.
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop_sorted |= ordered == NEG_INF
    drop_sorted[:, 0] = False
    removed |= torch.zeros_like(removed).scatter_(1, order, drop_sorted)
    return removed


def _below_top_k(scaled: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None) -> torch.Tensor:
    """Tokens below each row's k-th largest value; rows with top_k >= V keep everything."""
    vocab = scaled.shape[1]
    enabled = top_k < vocab
    k = top_k.clamp(1, vocab)
    if max_top_k is None:
        max_top_k = int(torch.where(enabled, k, 1).max())
    max_k = max(1, min(vocab, max_top_k))
    kth = scaled.topk(max_k, dim=-1).values.gather(1, (k.clamp_max(max_k) - 1).unsqueeze(1))
    kth = kth.masked_fill(~enabled.unsqueeze(1), NEG_INF)
    return scaled < kth
