"""The grammar service's HTTP API (served on its admin app's port).

`POST /v1/grammars/compile` `{"kind": ..., "spec": ...}` -> 200 `{"key", "kind", "source",
"cached", "compiled_bytes", "compile_seconds", "tokenizer_hash", "xgrammar_version"}`: the key
names a compiled grammar now stored in Redis (`meshllm:<cluster>:grammar:<key>`). 400 when the
spec is invalid, unsupported, too slow or too large to compile; 503 while the service starts or
when Redis is unreachable. Errors use the OpenAI error body, like every meshllm endpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from services.grammar.grammar_cache import (
    GrammarCache,
    GrammarRefused,
    GrammarStoreUnavailable,
)


class CompileRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str
    spec: str = ""


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def grammar_router(get_cache: Callable[[], GrammarCache | None]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/grammars/compile", response_model=None)
    async def compile_grammar(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = CompileRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            return _error(400, f"invalid request: {first['msg']}", "invalid_request_error", param)
        cache = get_cache()
        if cache is None:
            return _error(503, "the grammar service is starting", "service_unavailable")
        try:
            info = await cache.get(body.kind, body.spec)
        except GrammarRefused as exc:
            return _error(400, str(exc), "invalid_request_error", "spec")
        except GrammarStoreUnavailable as exc:
            return _error(503, str(exc), "service_unavailable")
        return {
            "key": info.key,
            "kind": info.kind,
            "source": info.source,
            "cached": info.source != "compiled",
            "compiled_bytes": info.compiled_bytes,
            "compile_seconds": info.compile_seconds,
            "tokenizer_hash": cache.tokenizer.hash,
            "xgrammar_version": cache.tokenizer.xgrammar_version,
        }

    return router
