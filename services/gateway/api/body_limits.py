"""Bounds on what a request body may cost before the gateway looks inside it.

Size: a declared `Content-Length` past `max_body_bytes` is refused before a byte is read; a
body without one (chunked) is read with a running count and refused as soon as it passes the
limit, so no more than the limit plus one chunk is ever held. Either way a 413.

Depth: JSON arrays and objects nested past `max_json_depth` are a 400, found by a scan over the
raw bytes (shared.json_depth) before the body is parsed, so nothing recursive (the JSON parser,
pydantic, jsonschema, our own walks) ever meets a body that would exhaust Python's recursion
limit. The same check applies to JSON sent inside a string field (a structured-output spec).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.gateway.api.errors import OpenAIError, invalid_request
from shared.json_depth import nesting_exceeds

if TYPE_CHECKING:  # the nesting check is pure and imported by core modules; only types here
    from starlette.requests import Request


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is larger than the gateway's limit of {limit} bytes "
        "(MESHLLM_MAX_BODY_BYTES)",
        code="request_too_large",
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or OpenAIError 413 once it is known to pass `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def check_nesting(text: bytes | str, max_depth: int, param: str | None = None) -> None:
    """400 when JSON `text` nests arrays/objects deeper than `max_depth`."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if nesting_exceeds(raw, max_depth):
        what = f"{param} nests" if param else "the request body nests"
        raise invalid_request(
            f"{what} JSON arrays/objects more than {max_depth} levels deep, past the gateway's "
            "limit (MESHLLM_MAX_JSON_DEPTH)",
            param,
        )
