"""Speculative decoding in the scheduler: lookahead slots, draft bookkeeping, acceptance stats.

The worker proposes drafts with each sampled token. With drafts on the worker (asynchronous
scheduling, `SpecDecoding.on_worker`) a decoding request without a grammar is scheduled 1 + k
tokens with k lookahead slots (StepPlan.spec_lookahead) and the worker verifies its own drafts
in them, so verify steps are planned ahead like plain decoding (docs/step-pipeline.md).
Otherwise, and always for a grammar request, the drafts come back in the result
(SampledTokens.draft_token_ids); the scheduler keeps them (`DraftBook`, validated by the
request's grammar) and sends them in the next plan (StepPlan.spec_token_ids). Either way the
result rolls `num_computed_tokens` back past the rejected drafts (`SpecDecoding.on_verified`).
Stats follow vLLM's spec-decode metrics. `lookahead` holds the one prefill-lookahead number and
the sliding-window retention derived from it.
"""

from services.scheduler.spec.drafts import DraftBook, SpecDecoding
from services.scheduler.spec.lookahead import (
    drafter_backoff,
    lookahead_of,
    prefill_lookahead_tokens,
    retained_tokens,
)
from services.scheduler.spec.stats import SpecDecodeStats

__all__ = [
    "DraftBook",
    "SpecDecodeStats",
    "SpecDecoding",
    "drafter_backoff",
    "lookahead_of",
    "prefill_lookahead_tokens",
    "retained_tokens",
]
