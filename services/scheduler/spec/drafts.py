"""Draft bookkeeping and lookahead slots for one scheduler.

Invariants:
- Lookahead slots are ordinary slots past the request's known tokens: a decoding request with
  k drafts is scheduled 1 + k tokens, so `allocate_slots` reserves KV for num_tokens + k, and
  the admission estimate (the same call) counts them. k never takes the request past its
  admission peak (prompt + max_tokens - 1 slots) nor past max_model_len - 1, so admission's
  per-request bound still holds.
- Only verified tokens are ever registered in the prefix cache (and so offered to the offload
  tier): allocation registers blocks full of *known* tokens only, and after a verification
  `num_computed_tokens` is rolled back to the verified tokens before any registration.
- Drafts are used once: a request's drafts are taken when scheduled (or dropped if it is not
  decoding then, e.g. preempted or resumed), never replayed.
- Drafts on the worker (`on_worker`, with asynchronous scheduling): a request without a
  grammar gets lookahead slots instead of drafts (StepPlan.spec_lookahead); the worker
  verifies its own drafts in them. The slots are planned before the previous step's result, so
  the scheduler counts every in-flight slot as accepted: `num_output_placeholders` holds
  1 + slots per in-flight step (`num_lookahead_placeholders` the slots), and
  `num_computed_tokens` runs ahead of the verified tokens by the in-flight slots until each
  result rolls it back. The worker, which knows the true count, cuts its drafts at max_tokens
  (as `drafts_to_verify` does) and skips a request whose max_tokens it reached; the scheduler
  allocates KV only up to the request's admission peak (`slots_to_allocate`), which the true
  count never passes. max_model_len (the scheduler's may be below the worker's) is still
  capped here: near it a request is planned from its results (`lookahead_slots` None).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.scheduler.request import Request
from services.scheduler.spec.stats import SpecDecodeStats
from services.scheduler.structured_output import StructuredOutputManager

log = logging.getLogger(__name__)


class DraftBook:
    """Unverified drafts per request id, as the worker proposed them (grammar-validated)."""

    def __init__(self) -> None:
        self._drafts: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._drafts)

    def put(self, request_id: str, drafts: Sequence[int]) -> None:
        if drafts:
            self._drafts[request_id] = list(drafts)
        else:
            self._drafts.pop(request_id, None)

    def pop(self, request_id: str) -> list[int]:
        return self._drafts.pop(request_id, [])


class SpecDecoding:
    """What the scheduler core calls around drafts; K = 0 disables it (drafts are ignored)."""

    def __init__(self, num_spec_tokens: int, max_model_len: int, on_worker: bool = False) -> None:
        self.k = num_spec_tokens
        self.max_model_len = max_model_len
        self.on_worker = on_worker and num_spec_tokens > 0
        self.book = DraftBook()
        self.stats = SpecDecodeStats()

    def lookahead_slots(self, request: Request, num_new: int, budget: int) -> int | None:
        """Slots for the worker's own drafts after the request's `num_new` tokens this step
        (drafts on the worker): K, capped by the step budget and by max_model_len counted as
        if every in-flight slot were accepted (the worker cuts its drafts at max_tokens
        itself); 0 unless decoding (a prompt's last token has no drafts yet). None: not this
        step, since max_model_len binds while steps are in flight whose results may leave room
        for more: the drafts a step verifies must not depend on how far ahead it was planned
        (sampled drafts' output depends on their number)."""
        if num_new != 1 or request.num_computed_tokens < request.num_prompt_tokens:
            return 0
        pending = request.num_output_placeholders  # 1 + slots of each step in flight
        room_len = self.max_model_len - 1 - request.num_tokens - pending
        if pending and room_len < self.k:
            return None
        return max(0, min(self.k, budget - 1, room_len))

    def slots_to_allocate(self, request: Request, num_new: int) -> int:
        """Of `num_new` tokens planned with lookahead slots, those KV is allocated for: up to
        the request's admission peak (prompt + max_tokens - 1 slots); 0: none (the peak is
        allocated). `num_computed_tokens` counts in-flight slots as accepted, so it may pass
        the peak; the worker's true count plus its drafts, cut at max_tokens, never does."""
        peak = request.num_prompt_tokens + request.sampling.max_tokens - 1
        return max(0, min(num_new, peak - request.num_computed_tokens))

    def drafts_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The drafts to schedule after the request's `num_new` tokens this step (taken out of
        the book). Only a decoding request (one new token) verifies drafts; k is capped by K,
        the step budget, max_tokens and max_model_len."""
        drafts = self.book.pop(request.request_id)
        if not drafts or num_new != 1:
            return []
        room_tokens = request.sampling.max_tokens - request.num_output_tokens - 1
        room_len = self.max_model_len - 1 - request.num_tokens
        k = min(len(drafts), self.k, budget - 1, room_tokens, room_len)
        return drafts[:k] if k > 0 else []

    def on_verified(
        self, request: Request, slots: int, num_tokens: int, num_drafts: int | None = None
    ) -> None:
        """A verification in `slots` lookahead slots returned `num_tokens` tokens (accepted
        drafts + 1): roll `num_computed_tokens` back past the rejected drafts and the unused
        slots, whose KV slots are simply overwritten by later steps. `num_drafts`: the drafts
        verified, when fewer than the slots (the worker's own drafts)."""
        drafts = slots if num_drafts is None else min(num_drafts, slots)
        accepted = max(0, min(num_tokens - 1, drafts))
        request.num_computed_tokens -= slots - accepted
        if drafts:
            self.stats.observe(drafts, accepted)

    def on_proposed(
        self,
        request: Request,
        drafts: Sequence[int] | None,
        structured: StructuredOutputManager,
    ) -> None:
        """Keep the worker's drafts for the request's next step; a constrained request keeps
        only the prefix its grammar allows (validated from the constraint start)."""
        if self.k <= 0 or not drafts:
            self.book.pop(request.request_id)
            return
        drafts = list(drafts[: self.k])
        grammar = structured.get(request.request_id)
        if grammar is not None:
            drafts = grammar.validate_drafts(request.all_token_ids, drafts)
        self.book.put(request.request_id, drafts)

    def forget(self, request_id: str) -> None:
        self.book.pop(request_id)
