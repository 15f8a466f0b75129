"""One request's grammar state: an xgrammar matcher plus the reasoning latch.

The matcher's state always equals the grammar-relevant tokens the request has accepted (those
from each window's constraint start on). Validating drafts and filling bitmask rows advance it
tentatively and roll back before returning; only `accept` moves it for good. So the three uses
see one consistent state, and a step that is retried or replanned never double-counts tokens.

A grammar that rejects a token never raises: a rejected draft is trimmed (logged), a rejected
sampled token ends the request with an error, and grammar termination (its stop token
accepted) ends it with "stop". A rejection where the grammar allows no token at all is the
request's fault, not the engine's: its constraint needs a string the model's vocabulary cannot
spell (a character with no token, for example), so the error is marked an invalid request.
Any other rejection (the mask was not applied, or conflicted with another mask) is internal.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from services.scheduler.structured_output.reasoning import (
    ReasoningConfig,
    constraint_start,
    reasoning_ended,
)

if TYPE_CHECKING:
    import numpy as np
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)

#: A draft slot the drafter left empty (it proposed fewer than K tokens).
PAD_DRAFT = -1
ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


@dataclass(frozen=True)
class Accepted:
    """What the grammar made of a step's sampled tokens.

    `num_tokens`: how many of them stand (the rest are dropped). `finish_reason`: "stop" when
    the grammar terminated on the last standing token, "error" when the next token was rejected
    (then `error` says why, and `invalid_request` whether the grammar had no token to allow),
    else None."""

    num_tokens: int
    finish_reason: Literal["stop", "error"] | None = None
    stop_token_id: int | None = None
    error: str | None = None
    invalid_request: bool = False


class RequestGrammar:
    def __init__(
        self, request_id: str, grammar: CompiledGrammar, reasoning: ReasoningConfig
    ) -> None:
        import xgrammar as xgr

        self.request_id = request_id
        self.matcher: Any = xgr.GrammarMatcher(grammar)
        self.vocab_size: int = grammar.tokenizer_info.vocab_size
        self.reasoning = reasoning
        self._reasoning_ended: bool | None = None  # the latch; None until first use
        self._num_accepted = 0  # tokens the matcher accepted for good

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    @property
    def reasoning_ended(self) -> bool | None:
        return self._reasoning_ended

    def constraint_start(self, history: Sequence[int], window: Sequence[int]) -> int:
        return constraint_start(
            window,
            history=history,
            marker=self.reasoning.end_token_ids,
            reasoning_in_play=self._reasoning_in_play(history),
        )

    def _reasoning_in_play(self, history: Sequence[int]) -> bool:
        if not self.reasoning.has_parser or self.reasoning.enable_in_reasoning:
            return False
        if self._reasoning_ended is None:
            # First use: `history` is the prompt (nothing was generated before).
            self._reasoning_ended = reasoning_ended(history, self.reasoning)
        return not self._reasoning_ended

    def _dead_end(self) -> bool:
        """The grammar is not finished but allows no token of the vocabulary next."""
        import numpy as np

        if self.matcher.is_terminated():
            return False
        mask = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        self.matcher.fill_next_token_bitmask(mask, 0)
        return not mask.any()

    # --- the three uses ---------------------------------------------------------------------

    def validate_drafts(self, history: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows. Drafts before the constraint start
        are kept unchecked; the first rejected one and everything after it are trimmed, and so
        is padding (a padding slot ends the drafts)."""
        if PAD_DRAFT in drafts:
            drafts = drafts[: list(drafts).index(PAD_DRAFT)]
        start = self.constraint_start(history, drafts)
        if start >= len(drafts):
            return list(drafts)
        matcher = self.matcher
        advanced = 0
        for token in drafts[start:]:
            if matcher.is_terminated() or not matcher.accept_token(token):
                log.warning(
                    "grammar rejects draft token %d at %d; drafts trimmed",
                    token,
                    start + advanced,
                    extra={"request_id": self.request_id},
                )
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
        return list(drafts[: start + advanced])

    def fill_bitmask(
        self, history: Sequence[int], drafts: Sequence[int], out: np.ndarray, first_row: int
    ) -> bool:
        """Fill rows `first_row .. first_row + len(drafts)`: row i masks the token sampled after
        drafts[:i] (row len(drafts) is the bonus). Row i is real iff i >= the constraint start;
        rows before it, and rows after the first padding draft, are all-allowed without asking
        the matcher (verification stops at the first rejected draft, so they are never used).
        Returns whether any row restricts anything."""
        num_rows = len(drafts) + 1
        out[first_row : first_row + num_rows] = ALL_ALLOWED
        start = self.constraint_start(history, drafts)
        matcher = self.matcher
        restricts = False
        advanced = 0
        for i in range(start, num_rows):
            if matcher.is_terminated():
                break
            restricts |= bool(matcher.fill_next_token_bitmask(out, first_row + i))
            if i == len(drafts):
                break
            token = drafts[i]
            if token == PAD_DRAFT:
                break
            if not matcher.accept_token(token):
                log.warning(
                    "grammar rejects draft token %d at %d while masking; later rows unmasked",
                    token,
                    i,
                    extra={"request_id": self.request_id},
                )
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
        return restricts

    def accept(self, history: Sequence[int], tokens: Sequence[int]) -> Accepted:
        """Advance the grammar by a step's accepted tokens (drafts that passed, then the bonus /
        sampled token). Only tokens from the constraint start count; a reasoning-end marker in
        them latches "ended"."""
        in_play = self._reasoning_in_play(history)
        start = self.constraint_start(history, tokens)
        if in_play and start <= len(tokens):
            self._reasoning_ended = True
        matcher = self.matcher
        for j in range(start, len(tokens)):
            token = tokens[j]
            if matcher.is_terminated() or not matcher.accept_token(token):
                if self._dead_end():
                    message = (
                        "the structured-output constraint cannot be completed with this "
                        f"model's vocabulary: after {self._num_accepted} constrained tokens it "
                        "allows no token at all"
                    )
                    log.info(message, extra={"request_id": self.request_id})
                    return Accepted(j, "error", error=message, invalid_request=True)
                message = f"the model produced token {token}, which the grammar does not allow"
                log.warning(message, extra={"request_id": self.request_id})
                return Accepted(j, "error", error=message)
            self._num_accepted += 1
            if matcher.is_terminated():
                return Accepted(j + 1, "stop", stop_token_id=token)
        return Accepted(len(tokens))
