"""`response_format` and `structured_outputs` -> the GrammarRef carried by a SubmitRequest.

Compiling a grammar is the grammar service's job (see grammar_client); here only the shape is
checked, so a malformed spec is a 400 at once: a JSON schema must be a valid JSON schema, a
structural tag valid JSON, regexes, grammars and choices non-empty.
The schema text keeps the client's key order: property order decides the generated order.
JSON sent as a string (`structured_outputs.json`, `structural_tag`) gets the body's nesting
limit before it is parsed, as the body itself did.
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import exceptions as jsonschema_errors
from jsonschema import validators

from services.gateway.api.body_limits import check_nesting
from services.gateway.api.errors import invalid_request
from services.gateway.api.protocol_openai import ResponseFormat, StructuredOutputs
from shared.protocol import GrammarRef


def grammar_ref(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    *,
    max_depth: int,
) -> GrammarRef | None:
    constrained_format = response_format is not None and response_format.type != "text"
    if constrained_format and structured_outputs is not None:
        raise invalid_request(
            "give either response_format or structured_outputs, not both", "structured_outputs"
        )
    if response_format is not None and constrained_format:
        return _from_response_format(response_format)
    if structured_outputs is not None:
        return _from_structured_outputs(structured_outputs, max_depth)
    return None


def grammar_param(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None
) -> str | None:
    """The request field the constraint came from: the `param` of a 400 when it does not
    compile (call after `grammar_ref` accepted the shape)."""
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_schema":
            return "response_format.json_schema.schema"
        return "response_format"
    so = structured_outputs
    if so is None:
        return None
    if so.json_ is not None:
        return "structured_outputs.json"
    if so.json_object:
        return "structured_outputs.json_object"
    for field in ("regex", "grammar", "choice", "structural_tag"):
        if getattr(so, field) is not None:
            return f"structured_outputs.{field}"
    return "structured_outputs"


def _from_response_format(fmt: ResponseFormat) -> GrammarRef:
    if fmt.type == "json_object":
        return GrammarRef(kind="json_object", spec="")
    assert fmt.json_schema is not None  # ResponseFormat's validator guarantees it
    schema = fmt.json_schema.schema_
    check_schema(schema, "response_format.json_schema.schema")
    return GrammarRef(kind="json_schema", spec=json.dumps(schema, ensure_ascii=False))


def _from_structured_outputs(so: StructuredOutputs, max_depth: int) -> GrammarRef:
    param = "structured_outputs"
    if so.json_ is not None:
        schema: Any = so.json_
        if isinstance(schema, str):
            check_nesting(schema, max_depth, f"{param}.json")
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise invalid_request(f"json is not valid JSON: {exc}", f"{param}.json") from None
        check_schema(schema, f"{param}.json")
        return GrammarRef(kind="json_schema", spec=json.dumps(schema, ensure_ascii=False))
    if so.json_object:
        return GrammarRef(kind="json_object", spec="")
    if so.regex is not None:
        return GrammarRef(kind="regex", spec=_non_empty(so.regex, f"{param}.regex"))
    if so.grammar is not None:
        return GrammarRef(kind="grammar", spec=_non_empty(so.grammar, f"{param}.grammar"))
    if so.choice is not None:
        if not so.choice or not all(so.choice):
            raise invalid_request(
                "choice must be a non-empty list of non-empty strings", f"{param}.choice"
            )
        return GrammarRef(kind="choice", spec=json.dumps(so.choice, ensure_ascii=False))
    assert so.structural_tag is not None  # exactly one kind is set (StructuredOutputs)
    tag = _non_empty(so.structural_tag, f"{param}.structural_tag")
    check_nesting(tag, max_depth, f"{param}.structural_tag")
    try:
        parsed = json.loads(tag)
    except ValueError as exc:
        raise invalid_request(
            f"structural_tag is not valid JSON: {exc}", f"{param}.structural_tag"
        ) from None
    if not isinstance(parsed, dict):
        raise invalid_request("structural_tag must be a JSON object", f"{param}.structural_tag")
    return GrammarRef(kind="structural_tag", spec=tag)


def check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict | bool):
        raise invalid_request("a JSON schema must be an object (or a boolean)", param)
    try:
        validators.validator_for(schema).check_schema(schema)
    except jsonschema_errors.SchemaError as exc:
        raise invalid_request(f"invalid JSON schema: {exc.message}", param) from None
    except RecursionError:
        # jsonschema recurses ~8 frames per level: only an operator's MESHLLM_MAX_JSON_DEPTH
        # far above the default lets a schema this deep through.
        raise invalid_request("the JSON schema is nested too deeply to check", param) from None


def _non_empty(value: str, param: str) -> str:
    if not value.strip():
        raise invalid_request("must not be empty", param)
    return value
