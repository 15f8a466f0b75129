"""A structured-output spec (kind, spec text) -> what xgrammar is asked to compile.

Pure and fast: everything that can be refused without compiling is refused here, with a message
that names the problem, so the 400 the client sees says what to fix. In particular JSON-schema
keywords that xgrammar 0.2 accepts but silently does not enforce (measured: `uniqueItems`,
`contains`, `not`, `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`, a multi-schema
`allOf`) are refused: a constraint the output may violate is worse than a clear error.

Kinds (GrammarRef.kind): `json_schema` (the schema as JSON text), `json_object` (any JSON
object; spec ignored), `regex`, `choice` (a JSON list of literal strings, compiled as an
EBNF alternation of escaped literals), `grammar` (EBNF/GBNF when it has `::=`, else Lark),
`structural_tag` (xgrammar's structural tag JSON, or vLLM's legacy
`{"structures": [...], "triggers": [...]}`).

JSON specs nested deeper than MAX_JSON_SPEC_DEPTH are refused on the raw text, before they are
parsed: Python's parser and the keyword walk below recurse per level and would fail near a
thousand levels with a RecursionError (a 500), and xgrammar's compile time and output size grow
quadratically with depth (measured: 100 levels of nested arrays, 0.5 s and 8.6 MB; 400 levels,
12 s and 144 MB).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from shared.json_depth import nesting_exceeds

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "structural_tag",
)
Method = Literal["json_schema", "json_object", "regex", "ebnf", "lark", "structural_tag"]

#: Bump when what a (kind, spec) compiles to changes (options below, the choice encoding), so
#: stale cache entries are never served under the new meaning. 2: JSON schemas' bounded strings
#: are JSON characters (json_strings.py).
COMPILE_FORMAT = 2
#: Strict JSON schemas (as vLLM): no properties or items beyond the schema's.
JSON_STRICT_MODE = True
#: Arrays/objects nested deeper than this in a JSON spec are refused. Twice the gateway's
#: default body limit (MESHLLM_MAX_JSON_DEPTH, 64), so a gateway configured up to it is served;
#: xgrammar compiles a schema this deep in about a second.
MAX_JSON_SPEC_DEPTH = 128


class GrammarSpecError(ValueError):
    """The spec is refused; the message is meant for the client."""


@dataclass(frozen=True)
class CompileJob:
    """One xgrammar compilation: the compiler method and its source text.

    `json_any_whitespace`: JSON may put any whitespace between tokens (vLLM's default), or
    compact JSON with fixed separators `, ` and `: ` (our default: small models given free
    whitespace tend to emit newlines until they run out of tokens)."""

    method: Method
    source: str
    json_any_whitespace: bool = False


def compile_job(kind: str, spec: str, *, json_any_whitespace: bool = False) -> CompileJob:
    """Check `spec` for its `kind` and say how to compile it. Raises GrammarSpecError."""
    job = _job(kind, spec)
    if json_any_whitespace and job.method in ("json_schema", "json_object"):
        return CompileJob(job.method, job.source, json_any_whitespace=True)
    return job


def _job(kind: str, spec: str) -> CompileJob:
    if kind == "json_schema":
        schema = _parse_json(spec, "json_schema")
        if not isinstance(schema, dict | bool):
            raise GrammarSpecError("a JSON schema must be an object (or a boolean)")
        problems = unsupported_json_schema_features(schema)
        if problems:
            raise GrammarSpecError(
                "unsupported JSON schema keyword(s), not enforced by the grammar engine: "
                + "; ".join(problems)
            )
        return CompileJob("json_schema", spec)
    if kind == "json_object":
        return CompileJob("json_object", "")
    if kind == "regex":
        return CompileJob("regex", _non_empty(spec, "regex"))
    if kind == "choice":
        return CompileJob("ebnf", choice_ebnf(_choices(spec)))
    if kind == "grammar":
        text = _non_empty(spec, "grammar")
        return CompileJob("ebnf" if "::=" in text else "lark", text)
    if kind == "structural_tag":
        tag = _parse_json(spec, "structural_tag")
        if not isinstance(tag, dict):
            raise GrammarSpecError("a structural tag must be a JSON object")
        return CompileJob("structural_tag", spec)
    raise GrammarSpecError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")


def grammar_key(job: CompileJob, kind: str, spec: str, tokenizer_hash: str, version: str) -> str:
    """The cache key: every input that decides the compiled grammar, hashed."""
    options = {"json_any_whitespace": job.json_any_whitespace}
    material = json.dumps(
        [COMPILE_FORMAT, kind, spec, tokenizer_hash, version, options],
        ensure_ascii=False,
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: exactly the literal strings, escaped for xgrammar's EBNF."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in choices)


def _ebnf_escape(text: str) -> str:
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _choices(spec: str) -> list[str]:
    choices = _parse_json(spec, "choice")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise GrammarSpecError("choice must be a JSON list of strings")
    if not choices:
        raise GrammarSpecError("choice must not be empty")
    if not all(choices):
        raise GrammarSpecError("choice strings must not be empty")
    return choices


def _parse_json(spec: str, what: str) -> Any:
    if nesting_exceeds(spec.encode("utf-8", "surrogatepass"), MAX_JSON_SPEC_DEPTH):
        raise GrammarSpecError(
            f"{what} nests JSON arrays/objects more than {MAX_JSON_SPEC_DEPTH} levels deep"
        )
    try:
        return json.loads(spec)
    except ValueError as exc:
        raise GrammarSpecError(f"{what} is not valid JSON: {exc}") from None


def _non_empty(spec: str, what: str) -> str:
    if not spec.strip():
        raise GrammarSpecError(f"{what} must not be empty")
    return spec


# --- JSON schema keywords xgrammar does not enforce -------------------------------------------

#: Refused wherever they appear as a schema keyword (not as a property name).
_UNENFORCED = frozenset(
    {"contains", "minContains", "maxContains", "not", "if", "then", "else"}
    | {"dependentRequired", "dependentSchemas", "dependencies"}
)
#: Keywords whose value is one subschema / a list of them / a name -> subschema map.
_ONE = (
    "additionalProperties",
    "items",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_json_schema_features(schema: Any) -> list[str]:
    """Each keyword the schema uses that xgrammar would ignore, as 'path: keyword'."""
    return [f"{path or '#'}: {word}" for path, word in _walk(schema, "")]


def _walk(schema: Any, path: str) -> Iterator[tuple[str, str]]:
    if not isinstance(schema, dict):
        return
    for word in sorted(_UNENFORCED & schema.keys()):
        yield path, word
    if schema.get("uniqueItems") is True:
        yield path, "uniqueItems"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        yield path, "allOf with more than one schema"
    for word in _ONE:
        if word in schema:
            value = schema[word]
            if isinstance(value, list):  # draft-04 style tuple `items`
                for i, sub in enumerate(value):
                    yield from _walk(sub, f"{path}/{word}/{i}")
            else:
                yield from _walk(value, f"{path}/{word}")
    for word in _LIST:
        if isinstance(schema.get(word), list):
            for i, sub in enumerate(schema[word]):
                yield from _walk(sub, f"{path}/{word}/{i}")
    for word in _MAP:
        if isinstance(schema.get(word), dict):
            for name, sub in schema[word].items():
                yield from _walk(sub, f"{path}/{word}/{name}")
