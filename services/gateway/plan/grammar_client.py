"""The gateway's client of the grammar service: a structured-output spec -> its cache key.

Called before a constrained request is queued, so an invalid spec is a 400 naming the field
the client sent, and nothing reaches the bus that a scheduler could not load. The call goes
over the bus (`CompileGrammar` on the grammar service's calls stream, shared.rpc). The grammar
service not running, or no answer within `grammar_timeout_s`, is a 503 for constrained
requests only: the client object holds no state a failure could poison, and unconstrained
requests never call it.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from services.gateway.api.errors import OpenAIError
from shared.protocol import CompileGrammar, GrammarCompiled, GrammarRef
from shared.rpc import RpcCallError, RpcClient, RpcError

log = logging.getLogger(__name__)


class GrammarClient:
    def __init__(self, rpc: RpcClient, stream: str, timeout_s: float = 30.0) -> None:
        self.rpc = rpc
        self.stream = stream
        self.timeout_s = timeout_s

    async def compile(self, ref: GrammarRef, param: str | None) -> GrammarRef:
        """`ref` with the key of its compiled grammar. OpenAIError 400 (naming `param`) when the
        spec does not compile, 503 when the grammar service cannot answer."""
        what = f"invalid {ref.kind.replace('_', ' ')}"
        try:
            request = CompileGrammar(kind=ref.kind, spec=ref.spec)
        except ValidationError as exc:
            raise OpenAIError(400, f"{what}: {exc.errors()[0]['msg']}", param=param) from None
        try:
            # Safe to send twice: compiling is idempotent and the service's cache is single flight.
            reply = await self.rpc.call(
                self.stream, request, GrammarCompiled, self.timeout_s, attempts=2
            )
        except RpcError as exc:
            if exc.kind == "bad_request":
                raise OpenAIError(400, f"{what}: {exc.message}", param=param) from None
            log.warning("the grammar service answered %s: %s", exc.kind, exc.message)
            raise _unavailable(exc.message) from None
        except RpcCallError as exc:
            log.warning("no answer from the grammar service: %s", exc)
            raise _unavailable(str(exc)) from None
        return ref.model_copy(update={"key": reply.key})


def _unavailable(detail: str) -> OpenAIError:
    return OpenAIError(
        503,
        "structured outputs are unavailable: the grammar service cannot compile the request's "
        f"grammar ({detail}); retry later, or send the request without a structured-output "
        "constraint",
        type_="service_unavailable",
        code="grammar_service_unavailable",
    )
