"""Request bodies in the gateway's OpenAPI document (/openapi.json).

The routes read raw bodies and parse them with the gateway's own models (so a bad body is a
400 in OpenAI's shape, never FastAPI's 422), which hides the body types from FastAPI. They are
declared here instead, from those same models, so the document describes what each route takes
and tools that read it (clients, schemathesis) can build requests. Schemas are inlined rather
than put under components: FastAPI registers only the component schemas it finds itself, and
the request models are not recursive, so inlining always terminates.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_DEFS = "#/$defs/"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is parsed as `model`."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    inlined = _inline(schema, defs)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inlined}}}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_DEFS):
            target = _inline(defs[ref.removeprefix(_DEFS)], defs)
            return {**target, **{k: _inline(v, defs) for k, v in node.items() if k != "$ref"}}
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node
