"""The grammar service: compiles structured-output specs with xgrammar and caches them.

Start-up: the HTTP app answers /health at once; `start()` connects Redis, loads the served
model's tokenizer as an xgrammar TokenizerInfo (off the event loop, seconds), publishes it to
Redis for the schedulers, starts the compiler processes, and only then opens its `calls`
stream (/ready says 503 until then). `run()` serves the calls and keeps the TokenizerInfo
in Redis: it is published again whenever Redis loses it (every compile answer makes sure of
it too). The gateway calls `CompileGrammar` over the bus (calls.py) before queuing a request
and puts the returned key on the bus; schedulers load the compiled grammar from Redis by
that key and run the matcher in-process, so nothing here is on the per-token path. Replicas
share the calls stream through one consumer group.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from services.grammar.calls import compile_grammar
from services.grammar.compiler_pool import CompilerPool
from services.grammar.grammar_cache import GrammarCache
from services.grammar.tokenizer_identity import load_tokenizer_identity
from shared.config import GrammarSettings
from shared.grammar_store import GrammarKeys
from shared.model.source import resolve_model
from shared.protocol import CompileGrammar
from shared.rpc import RpcServer
from shared.service import Service

#: Calls handled at once. Most are cache hits (memory or Redis, well under a millisecond); the
#: compiler pool bounds the compilations among them.
MAX_CONCURRENT_CALLS = 64


class GrammarService(Service):
    name = "grammar"

    def __init__(self, settings: GrammarSettings) -> None:
        super().__init__(settings)
        self.settings: GrammarSettings = settings
        self.cache: GrammarCache | None = None
        self.pool: CompilerPool | None = None
        self.rpc: RpcServer | None = None

    async def start(self) -> None:
        await super().start()
        s = self.settings
        source = await asyncio.to_thread(resolve_model, s.model, s.model_cache_dir)
        tokenizer = await asyncio.to_thread(load_tokenizer_identity, source.hf_dir)
        self.pool = CompilerPool(
            tokenizer.info_json,
            size=s.compile_workers,
            max_threads=s.compile_threads,
            memory_limit_mb=s.compile_memory_mb,
        )
        await self.pool.start()
        cache = GrammarCache(
            self.bus.redis,
            GrammarKeys(s.cluster),
            self.pool,
            tokenizer,
            entries=s.cache_entries,
            ttl_s=s.cache_ttl_s,
            compile_timeout_s=s.compile_timeout_s,
            max_compiled_bytes=s.max_compiled_bytes,
            json_any_whitespace=s.json_whitespace == "any",
        )
        await cache.publish_tokenizer()
        self.cache = cache
        rpc = RpcServer(
            self.bus,
            self.streams.calls("grammar"),
            {CompileGrammar: partial(compile_grammar, cache)},
            service=self.name,
            instance_id=s.instance_id,
            reply_prefix=self.streams.rpc_reply_prefix,
            concurrency=MAX_CONCURRENT_CALLS,
            claim_idle_ms=s.claim_idle_ms,
        )
        await rpc.start()
        self.rpc = rpc  # calls are accepted from now on: ready

    async def run(self) -> None:
        assert self.rpc is not None and self.cache is not None, "start() sets them"
        keep = self.cache.keep_tokenizer(self.stopping, self.settings.heartbeat_interval_s)
        await asyncio.gather(self.rpc.run(self.stopping), keep)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        await super().close()

    async def check_ready(self) -> tuple[bool, dict[str, Any]]:
        ready, details = await super().check_ready()
        details["checks"]["compiler"] = "ok" if self.rpc is not None else "loading"
        return ready and self.rpc is not None, details

    def state(self) -> dict[str, Any]:
        out = super().state()
        if self.cache is not None and self.pool is not None:
            out["grammar"] = {
                "tokenizer_hash": self.cache.tokenizer.hash,
                "vocab_size": self.cache.tokenizer.vocab_size,
                "xgrammar_version": self.cache.tokenizer.xgrammar_version,
                "cached_grammars": self.cache.num_entries,
                "compiler_processes": self.pool.size,
                "idle_compiler_processes": self.pool.num_idle,
                "compiler_replacements": self.pool.replacements,
                "calls": self.rpc.state() if self.rpc else None,
            }
        return out
