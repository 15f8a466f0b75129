"""Errors the API returns, in OpenAI's body shape.

Every refusal is an `OpenAIError` carrying its HTTP status and the body OpenAI clients parse:
`{"error": {"message", "type", "param", "code"}}`. Core modules raise it; the HTTP edge renders
it. `param` names the offending request field (dotted, list indexes in brackets:
`messages[1].role`), so a client can point at what it sent wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in the gateway's planning processes and pickled back to the gateway.
        return (
            _rebuild,
            (self.status, self.message, self.type, self.param, self.code, self.headers),
        )


def _rebuild(
    status: int,
    message: str,
    type_: str,
    param: str | None,
    code: str | None,
    headers: dict[str, str],
) -> OpenAIError:
    return OpenAIError(status, message, type_=type_, param=param, code=code, headers=headers)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None) -> OpenAIError:
    """A 400 naming the field at fault."""
    return OpenAIError(400, message, param=param)


def param_path(loc: Sequence[int | str]) -> str | None:
    """A pydantic error location as an OpenAI `param`: ("messages", 1, "role") ->
    "messages[1].role"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None
