"""The CONTRACTS constraint-start table, run through validate -> bitmask -> accept.

Each case is one speculative step of one request: drafts to validate, bitmask rows for the
drafts plus the bonus token, then the accepted tokens (the valid drafts up to any padding, and
the bonus). The grammar is real xgrammar over a readable vocabulary (see conftest); the
reasoning-end marker is `</think>`. After the step, the mask for the next token shows where the
grammar stands, which proves which of the accepted tokens advanced it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from services.scheduler.structured_output.reasoning import ReasoningConfig
from services.scheduler.structured_output.request_grammar import PAD_DRAFT, RequestGrammar
from tests.unit.scheduler.structured_output.conftest import (
    ALL,
    COLON,
    END,
    EOS,
    HMM,
    KEY,
    LB,
    ONE,
    RB,
    THINK,
    TWO,
    X,
    allowed,
)

MARKED = ReasoningConfig(end_token_ids=(END,))
OPEN = [THINK, HMM]  # a prompt that leaves the model reasoning
CLOSED = [THINK, HMM, END]  # a prompt whose template closed the think block
PAD = PAD_DRAFT
DIGITS = frozenset({ONE, TWO})


@dataclass(frozen=True)
class Case:
    name: str
    prompt: list[int]
    drafts: list[int]
    bonus: int
    start: int  # constraint start of the drafts window
    valid: list[int]  # validate_drafts(drafts)
    rows: list[frozenset[int]]  # allowed tokens of each row: drafts then the bonus
    after: frozenset[int]  # allowed next tokens once the step's tokens are accepted
    reasoning: ReasoningConfig = MARKED


CASES = [
    Case(
        "marker in the prompt",
        CLOSED,
        [LB, KEY],
        COLON,
        start=0,
        valid=[LB, KEY],
        rows=[frozenset({LB}), frozenset({KEY}), frozenset({COLON})],
        after=DIGITS,
    ),
    Case(
        "marker at draft 0",
        OPEN,
        [END, LB, KEY],
        COLON,
        start=1,
        valid=[END, LB, KEY],
        rows=[ALL, frozenset({LB}), frozenset({KEY}), frozenset({COLON})],
        after=DIGITS,
    ),
    Case(
        "marker in the middle",
        OPEN,
        [HMM, END, LB],
        KEY,
        start=2,
        valid=[HMM, END, LB],
        rows=[ALL, ALL, frozenset({LB}), frozenset({KEY})],
        after=frozenset({COLON}),
    ),
    Case(
        "marker as the last draft",
        OPEN,
        [HMM, HMM, END],
        LB,
        start=3,
        valid=[HMM, HMM, END],
        rows=[ALL, ALL, ALL, frozenset({LB})],
        after=frozenset({KEY}),
    ),
    Case(
        "marker as the bonus token",
        OPEN,
        [HMM, HMM],
        END,
        start=3,
        valid=[HMM, HMM],
        rows=[ALL, ALL, ALL],
        after=frozenset({LB}),  # latched: the next token is the grammar's first
    ),
    Case(
        "two markers: the last wins",
        OPEN,
        [END, X, END, LB],
        KEY,
        start=3,
        valid=[END, X, END, LB],  # X precedes the start: kept unchecked
        rows=[ALL, ALL, ALL, frozenset({LB}), frozenset({KEY})],
        after=frozenset({COLON}),
    ),
    Case(
        "no marker",
        OPEN,
        [HMM, X],
        HMM,
        start=3,
        valid=[HMM, X],
        rows=[ALL, ALL, ALL],
        after=ALL,  # still reasoning
    ),
    Case(
        "reasoning disabled (enable_in_reasoning)",
        OPEN,
        [LB, KEY],
        COLON,
        start=0,
        valid=[LB, KEY],
        rows=[frozenset({LB}), frozenset({KEY}), frozenset({COLON})],
        after=DIGITS,
        reasoning=ReasoningConfig(end_token_ids=(END,), enable_in_reasoning=True),
    ),
    Case(
        "no reasoning parser",
        OPEN,
        [LB],
        KEY,
        start=0,
        valid=[LB],
        rows=[frozenset({LB}), frozenset({KEY})],
        after=frozenset({COLON}),
        reasoning=ReasoningConfig(),
    ),
    Case(
        "padding drafts",
        CLOSED,
        [LB, PAD, PAD],
        KEY,
        start=0,
        valid=[LB],
        rows=[frozenset({LB}), frozenset({KEY}), ALL, ALL],  # after the first pad: no work
        after=frozenset({COLON}),
    ),
    Case(
        "an invalid draft after the marker",
        OPEN,
        [END, LB, X, KEY],
        KEY,
        start=1,
        valid=[END, LB],  # X rejected: it and everything after it trimmed
        rows=[ALL, frozenset({LB}), frozenset({KEY})],
        after=frozenset({COLON}),
    ),
]


def mask(grammar: RequestGrammar, history: list[int], drafts: list[int]) -> list[frozenset[int]]:
    rows = np.full((len(drafts) + 1, 1), 12345, dtype=np.int32)  # garbage: every row is written
    grammar.fill_bitmask(history, drafts, rows, 0)
    return [allowed(rows, i) for i in range(len(drafts) + 1)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_constraint_start_table(case: Case, compiled: Any) -> None:
    grammar = RequestGrammar("req", compiled, case.reasoning)
    real = case.drafts[: case.drafts.index(PAD)] if PAD in case.drafts else case.drafts
    assert grammar.constraint_start(case.prompt, real) == case.start

    valid = grammar.validate_drafts(case.prompt, case.drafts)
    assert valid == case.valid
    masked = case.drafts if PAD in case.drafts else valid
    assert mask(grammar, case.prompt, masked) == case.rows

    step = [*valid, case.bonus]
    outcome = grammar.accept(case.prompt, step)
    assert (outcome.num_tokens, outcome.finish_reason) == (len(step), None)
    assert mask(grammar, case.prompt + step, []) == [case.after]


def test_validating_and_masking_leave_the_grammar_where_it_was(compiled: Any) -> None:
    grammar = RequestGrammar("req", compiled, MARKED)
    before = mask(grammar, CLOSED, [])
    grammar.validate_drafts(CLOSED, [LB, KEY, COLON, ONE])
    mask(grammar, CLOSED, [LB, KEY, COLON])
    assert mask(grammar, CLOSED, []) == before == [frozenset({LB})]


def test_an_invalid_draft_is_logged_and_trimmed_never_raised(
    compiled: Any, caplog: pytest.LogCaptureFixture
) -> None:
    grammar = RequestGrammar("req-7", compiled, MARKED)
    with caplog.at_level(logging.WARNING):
        assert grammar.validate_drafts(OPEN, [END, LB, X, KEY]) == [END, LB]
    assert any("rejects draft" in r.getMessage() for r in caplog.records)
    assert any(getattr(r, "request_id", None) == "req-7" for r in caplog.records)


def test_enable_in_reasoning_checks_the_marker_itself(compiled: Any) -> None:
    config = ReasoningConfig(end_token_ids=(END,), enable_in_reasoning=True)
    grammar = RequestGrammar("req", compiled, config)
    assert grammar.validate_drafts(OPEN, [END, LB]) == []


def test_a_rejected_sampled_token_finishes_with_an_error(compiled: Any) -> None:
    grammar = RequestGrammar("req", compiled, MARKED)
    outcome = grammar.accept(CLOSED, [LB, X, KEY])
    assert (outcome.num_tokens, outcome.finish_reason) == (1, "error")
    assert outcome.error is not None and str(X) in outcome.error


def test_termination_finishes_with_stop_on_the_stop_token(compiled: Any) -> None:
    grammar = RequestGrammar("req", compiled, ReasoningConfig())
    outcome = grammar.accept([], [LB, KEY, COLON, TWO, RB, EOS])
    assert (outcome.num_tokens, outcome.finish_reason, outcome.stop_token_id) == (6, "stop", EOS)
    assert grammar.is_terminated


def test_the_latch_is_read_from_the_prompt_once(compiled: Any) -> None:
    grammar = RequestGrammar("req", compiled, MARKED)
    assert grammar.reasoning_ended is None  # untouched until first use
    grammar.accept(OPEN, [HMM])
    assert grammar.reasoning_ended is False
    # Later histories are not rescanned: a marker that only the first use could have seen
    # would otherwise flip it. The marker arrives as an accepted token instead.
    grammar.accept([*OPEN, HMM], [END, LB])
    assert grammar.reasoning_ended is True
    assert mask(grammar, [*OPEN, HMM, END, LB], []) == [frozenset({KEY})]
