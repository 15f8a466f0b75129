"""grammar_spec: what is refused before compiling, how each kind compiles, the cache key."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.grammar.grammar_spec import (
    MAX_JSON_SPEC_DEPTH,
    GrammarSpecError,
    choice_ebnf,
    compile_job,
    grammar_key,
    unsupported_json_schema_features,
)


@pytest.mark.parametrize(
    ("schema", "problems"),
    [
        ({"type": "array", "uniqueItems": True}, ["#: uniqueItems"]),
        ({"type": "array", "uniqueItems": False}, []),
        ({"not": {"type": "string"}}, ["#: not"]),
        ({"if": {}, "then": {}, "else": {}}, ["#: else", "#: if", "#: then"]),
        ({"allOf": [{"type": "integer"}]}, []),
        ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, ["#: allOf with more than one schema"]),
        (
            {"type": "object", "properties": {"tags": {"type": "array", "contains": {}}}},
            ["/properties/tags: contains"],
        ),
        (
            {"$defs": {"x": {"dependentRequired": {}}}, "$ref": "#/$defs/x"},
            ["/$defs/x: dependentRequired"],
        ),
        ({"anyOf": [{"type": "string"}, {"items": {"not": {}}}]}, ["/anyOf/1/items: not"]),
        # Keyword names as property names or enum values are data, not keywords.
        ({"type": "object", "properties": {"not": {"type": "string"}, "if": {}}}, []),
        ({"enum": ["not", "contains"]}, []),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, []),
    ],
)
def test_unenforced_keywords_are_found_where_they_are_keywords(
    schema: dict[str, Any], problems: list[str]
) -> None:
    assert unsupported_json_schema_features(schema) == problems


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be an object"),
        ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
        ("regex", "  ", "must not be empty"),
        ("choice", "[]", "must not be empty"),
        ("choice", '["a", ""]', "must not be empty"),
        ("choice", '["a", 1]', "list of strings"),
        ("choice", '"a"', "list of strings"),
        ("grammar", "", "must not be empty"),
        ("structural_tag", "[1]", "JSON object"),
        ("xml", "<a/>", "unknown grammar kind"),
    ],
)
def test_refused_before_compiling(kind: str, spec: str, message: str) -> None:
    with pytest.raises(GrammarSpecError, match=message):
        compile_job(kind, spec)


def test_each_kind_compiles_with_the_right_method() -> None:
    assert compile_job("json_schema", '{"type": "integer"}').method == "json_schema"
    assert compile_job("json_object", "ignored").method == "json_object"
    assert compile_job("regex", "[0-9]+").method == "regex"
    assert compile_job("choice", '["a"]').method == "ebnf"
    assert compile_job("grammar", 'root ::= "a"').method == "ebnf"
    assert compile_job("grammar", 'start: "a" | "b"').method == "lark"
    assert compile_job("structural_tag", '{"type": "structural_tag"}').method == "structural_tag"


def test_choices_are_escaped_literals() -> None:
    text = choice_ebnf(['say "hi"', "back\\slash", "line\nbreak", "é"])
    assert text == 'root ::= "say \\"hi\\"" | "back\\\\slash" | "line\\x0abreak" | "é"'


def test_choice_literals_compile_to_exactly_those_strings() -> None:
    import xgrammar as xgr

    choices = ['say "hi"', "back\\slash", "tab\there", "ünï"]
    grammar = xgr.Grammar.from_ebnf(compile_job("choice", json.dumps(choices)).source)
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 256)] + ["\t"], xgr.VocabType.RAW)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar)
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    matcher = xgr.GrammarMatcher(compiled)
    assert not (matcher.accept_string("say hi") and matcher.is_completed())


def test_the_key_covers_every_input() -> None:
    job = compile_job("regex", "a+")
    base = grammar_key(job, "regex", "a+", "tok1", "0.2.9")
    assert base == grammar_key(job, "regex", "a+", "tok1", "0.2.9")
    assert len(base) == 64
    others = {
        grammar_key(job, "regex", "a*", "tok1", "0.2.9"),
        grammar_key(job, "grammar", "a+", "tok1", "0.2.9"),
        grammar_key(job, "regex", "a+", "tok2", "0.2.9"),
        grammar_key(job, "regex", "a+", "tok1", "0.3.0"),
    }
    assert base not in others and len(others) == 4
    schema = '{"type": "object"}'
    compact = compile_job("json_schema", schema)
    loose = compile_job("json_schema", schema, json_any_whitespace=True)
    assert grammar_key(compact, "json_schema", schema, "t", "v") != grammar_key(
        loose, "json_schema", schema, "t", "v"
    )


def nested_arrays_schema(depth: int) -> str:
    """A schema whose JSON nests `depth` objects deep (arrays of arrays of ... strings)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def test_a_json_spec_as_deep_as_the_limit_passes_one_level_more_is_refused() -> None:
    job = compile_job("json_schema", nested_arrays_schema(MAX_JSON_SPEC_DEPTH))
    assert job.method == "json_schema"
    with pytest.raises(GrammarSpecError, match=f"more than {MAX_JSON_SPEC_DEPTH} levels deep"):
        compile_job("json_schema", nested_arrays_schema(MAX_JSON_SPEC_DEPTH + 1))


@pytest.mark.parametrize("kind", ["json_schema", "structural_tag", "choice"])
def test_json_specs_nested_far_past_the_recursion_limit_are_refused_not_crashed(
    kind: str,
) -> None:
    """50,000 levels: json.loads alone would raise RecursionError (a 500 in the service)."""
    with pytest.raises(GrammarSpecError, match="levels deep"):
        compile_job(kind, "[" * 50_000 + "]" * 50_000)
    with pytest.raises(GrammarSpecError, match="levels deep"):
        compile_job(kind, '{"a": ' * 50_000 + "1" + "}" * 50_000)
