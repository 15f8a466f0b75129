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

    def __init__(self, num_spec_tokens: int, max_model_len: int) -> None:
        self.k = num_spec_tokens
        self.max_model_len = max_model_len
        self.book = DraftBook()
        self.stats = SpecDecodeStats()

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

    def on_verified(self, request: Request, num_drafts: int, num_tokens: int) -> None:
        """A verification returned `num_tokens` tokens (accepted drafts + 1): roll
        `num_computed_tokens` back past the rejected drafts, whose KV slots are simply
        overwritten by later steps."""
        accepted = max(0, min(num_tokens - 1, num_drafts))
        request.num_computed_tokens -= num_drafts - accepted
        self.stats.observe(num_drafts, accepted)

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
