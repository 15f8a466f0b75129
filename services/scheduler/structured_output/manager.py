"""The scheduler's structured-output state: one RequestGrammar per constrained request.

The scheduler core calls it at two points of a step: `grammar_bitmask` while planning (one
packed row per constrained request that samples this step: StepPlan.grammar_request_ids /
grammar_bitmask) and `accept` while applying the result. Matchers run in-process, so a decode
step costs a mask fill (microseconds), never a network hop. xgrammar is imported only when the
first constrained request arrives: an unconstrained deployment never loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.structured_output.reasoning import ReasoningConfig
from services.scheduler.structured_output.request_grammar import Accepted, RequestGrammar

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    def __init__(self, reasoning: ReasoningConfig | None = None) -> None:
        self.reasoning = reasoning or ReasoningConfig()
        self._grammars: dict[str, RequestGrammar] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    def add(self, request_id: str, grammar: CompiledGrammar) -> None:
        """A fresh matcher for the request (its grammar state starts at its first output)."""
        self._grammars[request_id] = RequestGrammar(request_id, grammar, self.reasoning)

    def remove(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)

    def get(self, request_id: str) -> RequestGrammar | None:
        return self._grammars.get(request_id)

    def grammar_bitmask(
        self,
        sampling: Sequence[tuple[str, Sequence[int]]],
        drafts: Mapping[str, Sequence[int]] | None = None,
    ) -> tuple[list[str], bytes]:
        """Rows for the constrained requests among `sampling` ((request id, tokens so far) of
        every request that samples this step). Requests whose row restricts nothing (reasoning
        still open) are left out: the worker treats unlisted requests as unconstrained. Rows
        are packed little-endian int32, ceil(vocab/32) words each, in the order of the ids;
        a request verifying drafts (`drafts`, speculative decoding) gets 1 + len(drafts)
        consecutive rows: one per draft, then the bonus row."""
        chosen = [(rid, g, h) for rid, h in sampling if (g := self._grammars.get(rid))]
        if not chosen:
            return [], b""
        vocab = chosen[0][1].vocab_size
        drafts = drafts or {}
        total = sum(1 + len(drafts.get(rid, ())) for rid, _, _ in chosen)
        rows = np.empty((total, bitmask_words(vocab)), dtype=np.int32)
        ids: list[str] = []
        used = 0
        for request_id, grammar, history in chosen:
            if grammar.vocab_size != vocab:
                log.error(
                    "grammar vocabulary %d differs from %d in this step; left unconstrained",
                    grammar.vocab_size,
                    vocab,
                    extra={"request_id": request_id},
                )
                continue
            window = drafts.get(request_id, ())
            if grammar.fill_bitmask(history, window, rows, used):
                ids.append(request_id)
                used += 1 + len(window)
        if not ids:
            return [], b""
        return ids, rows[:used].astype("<i4", copy=False).tobytes()

    def accept(
        self, request_id: str, history: Sequence[int], tokens: Sequence[int]
    ) -> Accepted | None:
        """Advance the request's grammar by a step's sampled tokens (`history`: its tokens
        before them). None for an unconstrained request."""
        grammar = self._grammars.get(request_id)
        if grammar is None:
            return None
        return grammar.accept(history, tokens)
