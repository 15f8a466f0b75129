"""Speculative decoding in the scheduler: lookahead slots, draft bookkeeping, acceptance stats.

The worker proposes drafts with each sampled token (SampledTokens.draft_token_ids); the
scheduler keeps them (`DraftBook`, validated by the request's grammar), schedules a decoding
request 1 + k tokens with k lookahead slots, sends the drafts in the plan
(StepPlan.spec_token_ids), and on the result rolls `num_computed_tokens` back past the rejected
drafts (`SpecDecoding.on_verified`). Stats follow vLLM's spec-decode metrics. `lookahead` holds
the one prefill-lookahead number and the sliding-window retention derived from it.
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
