"""JSON-schema grammars whose length-bounded strings are valid JSON strings.

xgrammar (0.2.9, the newest release; upstream issue mlc-ai/xgrammar#800, fixes #822/#880 not
merged) lowers a string with `minLength`/`maxLength` (and `propertyNames` bounds) to a bounded
repetition of the bare class `[^"\\\r\n]`. That class admits the raw control characters
U+0000-U+001F other than CR and LF, which RFC 8259 forbids inside a string: the output then
fails a strict parser (Python's `json.loads`: "Invalid control character"), though the grammar
accepted it. Seen in a load test of the mesh: a sampled "order" object with a raw \\x01 in a
12-character name. The same class also has no escape branch, so `\\"`, `\\n` or `\\u00e9` cannot
be written inside a bounded string at all, though an unbounded one can.

Here the schema's grammar is built as xgrammar prints it, and every such repetition unit becomes
one JSON character: an unescaped code point outside U+0000-U+001F, `"` and `\\`, or one escape
sequence (xgrammar's own `basic_escape` rule; a surrogate pair counts as two, as in
JavaScript's `length`). Nothing else changes: unbounded strings and `pattern` strings already
use xgrammar's JSON-aware rules.
"""

from __future__ import annotations

from typing import Any

#: The repetition unit of a length-bounded string as xgrammar 0.2 prints it.
BARE_STRING_CHAR = '([^\\"\\\\\\r\\n])'
#: One JSON string character: unescaped (no control character) or one escape sequence.
JSON_STRING_CHAR = '(([^\\0-\\x1f\\"\\\\]) | ("\\\\" basic_escape))'
ESCAPE_RULE = "basic_escape ::="


def json_string_ebnf(ebnf: str) -> str:
    """xgrammar's printed grammar of a JSON schema with its bounded-string units made JSON
    characters (module docstring). A grammar without them is returned unchanged."""
    if BARE_STRING_CHAR not in ebnf:
        return ebnf
    if ESCAPE_RULE not in ebnf:  # no escape helper to point at: close the control-character hole
        return ebnf.replace(BARE_STRING_CHAR, '([^\\0-\\x1f\\"\\\\])')
    return ebnf.replace(BARE_STRING_CHAR, JSON_STRING_CHAR)


def json_schema_grammar(schema: str, *, any_whitespace: bool, strict_mode: bool) -> Any:
    """The xgrammar Grammar of `schema`, its bounded strings fixed (json_string_ebnf)."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace, strict_mode=strict_mode
    )
    ebnf = str(grammar)
    fixed = json_string_ebnf(ebnf)
    return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)
