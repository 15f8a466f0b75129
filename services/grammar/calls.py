"""The grammar service's calls (shared.rpc on `Streams.calls("grammar")`): compile a spec.

`CompileGrammar{kind, spec}` -> `GrammarCompiled{key, ...}`: the key names a compiled grammar
now stored in Redis (`meshllm:<cluster>:grammar:<key>`). A spec that is invalid, unsupported,
too slow or too large to compile is an error answer of kind "bad_request" (the gateway's 400);
Redis unreachable is "unavailable" (its 503).
"""

from __future__ import annotations

from services.grammar.grammar_cache import GrammarCache, GrammarRefused, GrammarStoreUnavailable
from shared.protocol import CompileGrammar, GrammarCompiled
from shared.rpc import RpcError


async def compile_grammar(cache: GrammarCache, req: CompileGrammar) -> GrammarCompiled:
    try:
        info = await cache.get(req.kind, req.spec)
    except GrammarRefused as exc:
        raise RpcError("bad_request", str(exc)) from None
    except GrammarStoreUnavailable as exc:
        raise RpcError("unavailable", str(exc)) from None
    return GrammarCompiled(
        key=info.key,
        kind=req.kind,
        source=info.source,
        compiled_bytes=info.compiled_bytes,
        compile_seconds=info.compile_seconds,
        tokenizer_hash=cache.tokenizer.hash,
        xgrammar_version=cache.tokenizer.xgrammar_version,
    )
