"""Compiled grammars by key, read from the grammar service's Redis cache (the I/O edge).

The scheduler service loads a request's grammar when it accepts the request, before handing
it to the core, so the core never waits on I/O. Each key is deserialized once and kept (bounded
LRU); the TokenizerInfo the grammars need is read once per tokenizer hash. Deserialization runs
in a thread: a large grammar takes milliseconds to seconds, and the step loop must not stall.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from importlib import metadata
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from shared.grammar_store import GrammarEntry, GrammarEntryError, GrammarKeys

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from xgrammar import CompiledGrammar


class GrammarUnavailable(Exception):
    """The grammar cannot be loaded; the message says why (for the request's error)."""


class GrammarLoader:
    def __init__(self, redis: Redis, keys: GrammarKeys, *, entries: int = 256) -> None:
        self.redis = redis
        self.keys = keys
        self.entries = max(1, entries)
        self._grammars: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._tokenizers: dict[str, Any] = {}  # hash -> xgrammar TokenizerInfo
        self._loading: dict[str, asyncio.Task[CompiledGrammar]] = {}
        self.loads = 0  # deserializations done (cache misses)

    def cached(self, key: str) -> CompiledGrammar | None:
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
        return grammar

    async def load(self, key: str) -> CompiledGrammar:
        """The compiled grammar stored under `key`. Raises GrammarUnavailable."""
        if not key:
            raise GrammarUnavailable(
                "the request's grammar has no key: it was not compiled by the grammar service"
            )
        grammar = self.cached(key)
        if grammar is not None:
            return grammar
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(key))
            self._loading[key] = task
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(task)

    async def _load(self, key: str) -> CompiledGrammar:
        raw = await self._get(self.keys.grammar(key))
        if raw is None:
            raise GrammarUnavailable(f"compiled grammar {key} is not in the grammar cache")
        try:
            entry = GrammarEntry.decode(raw)
        except GrammarEntryError as exc:
            raise GrammarUnavailable(f"compiled grammar {key}: {exc}") from None
        installed = metadata.version("xgrammar")
        if entry.xgrammar_version != installed:
            raise GrammarUnavailable(
                f"compiled grammar {key} comes from xgrammar {entry.xgrammar_version}; "
                f"this scheduler runs {installed}"
            )
        tokenizer = await self._tokenizer(entry.tokenizer_hash)
        try:
            grammar = await asyncio.to_thread(_deserialize, entry.compiled, tokenizer)
        except Exception as exc:
            raise GrammarUnavailable(f"compiled grammar {key} does not load: {exc}") from None
        self.loads += 1
        self._grammars[key] = grammar
        while len(self._grammars) > self.entries:
            self._grammars.popitem(last=False)
        return grammar

    async def _tokenizer(self, tokenizer_hash: str) -> Any:
        info = self._tokenizers.get(tokenizer_hash)
        if info is None:
            raw = await self._get(self.keys.tokenizer(tokenizer_hash))
            if raw is None:
                raise GrammarUnavailable(f"tokenizer {tokenizer_hash} is not in the grammar cache")
            info = await asyncio.to_thread(_deserialize_tokenizer, raw)
            self._tokenizers[tokenizer_hash] = info
        return info

    async def _get(self, name: str) -> bytes | None:
        try:
            value = await self.redis.get(name)
        except (RedisError, OSError) as exc:
            raise GrammarUnavailable(f"the grammar cache is unreachable: {exc}") from None
        return value.encode() if isinstance(value, str) else value


def _deserialize(compiled: str, tokenizer: Any) -> CompiledGrammar:
    import xgrammar as xgr

    return xgr.CompiledGrammar.deserialize_json(compiled, tokenizer)


def _deserialize_tokenizer(raw: bytes) -> Any:
    import xgrammar as xgr

    return xgr.TokenizerInfo.deserialize_json(raw.decode())
