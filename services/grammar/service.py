"""The grammar service: compiles structured-output specs with xgrammar and caches them.

Start-up: the HTTP app answers /health at once; `start()` connects Redis, loads the served
model's tokenizer as an xgrammar TokenizerInfo (off the event loop, seconds) and starts the
compiler processes. /ready and the compile API answer 503 until then. `run()` publishes the
TokenizerInfo to Redis for the schedulers, and again whenever Redis loses it (every compile
answer makes sure of it too). The gateway calls `POST /v1/grammars/compile` before queuing a request and puts
the returned key on the bus; schedulers load the compiled grammar from Redis by that key and
run the matcher in-process, so nothing here is on the per-token path.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from services.grammar.compiler_pool import CompilerPool
from services.grammar.grammar_cache import GrammarCache
from services.grammar.routes import grammar_router
from services.grammar.tokenizer_identity import load_tokenizer_identity
from shared.config import GrammarSettings
from shared.grammar_store import GrammarKeys
from shared.model.source import resolve_model
from shared.service import Service


class GrammarService(Service):
    name = "grammar"

    def __init__(self, settings: GrammarSettings) -> None:
        super().__init__(settings)
        self.settings: GrammarSettings = settings
        self.cache: GrammarCache | None = None
        self.pool: CompilerPool | None = None

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
        self.cache = cache  # run() publishes the tokenizer info at once, and again if lost

    async def run(self) -> None:
        assert self.cache is not None
        await self.cache.keep_tokenizer(self.stopping, self.settings.heartbeat_interval_s)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        await super().close()

    async def check_ready(self) -> tuple[bool, dict[str, Any]]:
        ready, details = await super().check_ready()
        details["checks"]["compiler"] = "ok" if self.cache is not None else "loading"
        return ready and self.cache is not None, details

    def routes(self) -> list[APIRouter]:
        return [grammar_router(lambda: self.cache)]

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
            }
        return out
