"""The gateway's client of the grammar service: a structured-output spec -> its cache key.

Called before a constrained request is queued, so an invalid spec is a 400 naming the field
the client sent, and nothing reaches the bus that a scheduler could not load. The grammar
service being down or unreachable is a 503 for constrained requests only: the client object
holds no state a failure could poison, and unconstrained requests never call it.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from services.gateway.api.errors import OpenAIError
from shared.protocol import GrammarRef

log = logging.getLogger(__name__)

COMPILE_PATH = "/v1/grammars/compile"


class GrammarClient:
    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def compile(self, ref: GrammarRef, param: str | None) -> GrammarRef:
        """`ref` with the key of its compiled grammar. OpenAIError 400 (naming `param`) when the
        spec does not compile, 503 when the grammar service cannot answer."""
        try:
            resp = await self._http.post(COMPILE_PATH, json={"kind": ref.kind, "spec": ref.spec})
        except httpx.HTTPError as exc:
            log.warning("grammar service unreachable at %s: %r", self.base_url, exc)
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise _unavailable(detail) from None
        body = _json(resp)
        if resp.status_code == 200 and isinstance(body.get("key"), str) and body["key"]:
            return ref.model_copy(update={"key": body["key"]})
        message = _message(body) or resp.text[:200] or f"HTTP {resp.status_code}"
        if resp.status_code == 400:
            raise OpenAIError(400, f"invalid {ref.kind.replace('_', ' ')}: {message}", param=param)
        log.warning("grammar service answered %d: %s", resp.status_code, message)
        raise _unavailable(f"HTTP {resp.status_code}: {message}")

    async def close(self) -> None:
        await self._http.aclose()


def _unavailable(detail: str) -> OpenAIError:
    return OpenAIError(
        503,
        "structured outputs are unavailable: the grammar service cannot compile the request's "
        f"grammar ({detail}); retry later, or send the request without a structured-output "
        "constraint",
        type_="service_unavailable",
        code="grammar_service_unavailable",
    )


def _json(resp: httpx.Response) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _message(body: dict[str, Any]) -> str | None:
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    return None
