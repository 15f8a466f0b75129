"""JSON-schema grammars with length-bounded strings accept exactly valid JSON strings of those
lengths: no raw control character, escapes allowed and counted as one character each
(services/grammar/json_strings.py), compiled as the grammar service compiles them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.grammar.compiler_process import compile_grammar
from services.grammar.grammar_spec import compile_job
from services.grammar.json_strings import BARE_STRING_CHAR, json_string_ebnf

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2}},
        "free": {"type": "string"},
    },
    "required": ["name"],
}


@pytest.fixture(scope="module")
def compiled() -> Any:
    import xgrammar as xgr

    # Every printable byte, tab and the control characters as tokens of their own.
    vocab = [chr(c) for c in range(256)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return compile_grammar(compiler, compile_job("json_schema", json.dumps(SCHEMA)))


def accepts(compiled: Any, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text) and matcher.is_terminated())


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "abc"}',
        '{"name": "a\\"b"}',  # an escaped quote
        '{"name": "a\\nbcd"}',  # five characters, one of them an escape
        '{"name": "\\u00e9"}',
        '{"name": "ab", "tags": ["x\\ty", "zz"]}',
        '{"name": "ab", "free": "x\\ty"}',
    ],
)
def test_valid_json_within_the_bounds_is_accepted(compiled: Any, text: str) -> None:
    json.loads(text)  # the case itself is strict JSON
    assert accepts(compiled, text)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "ab\x01c"}',  # a raw control character in a bounded string
        '{"name": "a\tb"}',  # a raw tab
        '{"name": "ab", "tags": ["x\x02y"]}',
        '{"name": "ab", "free": "x\x01"}',  # unbounded strings were already strict
        '{"name": "a\\qb"}',  # not an escape
        '{"name": "a\\nbcde"}',  # six characters
        '{"name": "ab", "tags": ["x"]}',  # one character under minLength
    ],
)
def test_invalid_json_or_out_of_bounds_is_refused(compiled: Any, text: str) -> None:
    assert not accepts(compiled, text)


def test_a_grammar_without_bounded_strings_is_left_as_it_is() -> None:
    ebnf = 'root ::= "{" "}"'
    assert json_string_ebnf(ebnf) == ebnf


def test_without_the_escape_rule_only_the_control_characters_are_closed() -> None:
    ebnf = f"root ::= (({BARE_STRING_CHAR}))"
    fixed = json_string_ebnf(ebnf)
    assert BARE_STRING_CHAR not in fixed
    assert "\\0-\\x1f" in fixed and "basic_escape" not in fixed
