"""Gateway -> grammar service calls (shared.rpc): compile a structured-output spec.

The answer names the compiled grammar's key in the grammar cache (shared.grammar_store), where
schedulers load it. A spec the service refuses (invalid, unsupported, too slow or too large to
compile) is an `RpcErrorReply` of kind "bad_request" whose message is meant for the client.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import register
from shared.protocol.requests import GrammarKind
from shared.protocol.rpc import RpcReply, RpcRequest

#: The longest spec a compile call carries (characters). Far above any schema a model can
#: follow, far below the codec's message limit.
MAX_SPEC_CHARS = 4 * 2**20


@register
class CompileGrammar(RpcRequest):
    TYPE = "grammar_compile"
    VERSION = 1

    kind: GrammarKind
    spec: str = Field("", max_length=MAX_SPEC_CHARS)


@register
class GrammarCompiled(RpcReply):
    TYPE = "grammar_compiled"
    VERSION = 1

    key: str = Field(min_length=1, max_length=128)
    kind: GrammarKind
    source: Literal["memory", "redis", "compiled"]  # which tier answered
    compiled_bytes: int = Field(ge=0)
    compile_seconds: float = Field(0.0, ge=0.0)
    tokenizer_hash: str = Field(max_length=128)
    xgrammar_version: str = Field(max_length=64)

    @property
    def cached(self) -> bool:
        return self.source != "compiled"
