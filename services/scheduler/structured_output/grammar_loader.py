"""Compiled grammars by key, read from the grammar service's Redis cache (the I/O edge).

The scheduler service loads a request's grammar when it accepts the request, before handing
it to the core, so the core never waits on I/O. Each key is deserialized once and kept (bounded
LRU); the TokenizerInfo the grammars need is read once per tokenizer hash. Deserialization runs
in a thread: a large grammar takes milliseconds to seconds, and the step loop must not stall.

After a Redis restart (no persistence) the tokenizer info is gone until the grammar service
re-publishes it (within a heartbeat: services/grammar/grammar_cache.py), so a missing one is
waited for up to `tokenizer_wait_s`; a dead pooled connection (every one, after a restart) is
retried on a fresh one for up to `redis_retry_s`. Both bounded: the request then fails with the
reason, it never hangs.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from importlib import metadata
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from shared.bus_retry import BusUnavailable, retry
from shared.grammar_store import GrammarEntry, GrammarEntryError, GrammarKeys

TOKENIZER_POLL_S = 0.25

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from xgrammar import CompiledGrammar


class GrammarUnavailable(Exception):
    """The grammar cannot be loaded; the message says why (for the request's error)."""


class GrammarLoader:
    def __init__(
        self,
        redis: Redis,
        keys: GrammarKeys,
        *,
        entries: int = 256,
        tokenizer_wait_s: float = 5.0,
        redis_retry_s: float = 3.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.entries = max(1, entries)
        self.tokenizer_wait_s = tokenizer_wait_s
        self.redis_retry_s = redis_retry_s
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
            name = self.keys.tokenizer(tokenizer_hash)
            deadline = time.monotonic() + self.tokenizer_wait_s
            while (raw := await self._get(name)) is None:
                if time.monotonic() >= deadline:
                    raise GrammarUnavailable(
                        f"tokenizer {tokenizer_hash} is not in the grammar cache "
                        f"(waited {self.tokenizer_wait_s:.0f} s for the grammar service)"
                    )
                await asyncio.sleep(TOKENIZER_POLL_S)
            try:
                info = await asyncio.to_thread(_deserialize_tokenizer, raw)
            except Exception as exc:
                raise GrammarUnavailable(
                    f"tokenizer {tokenizer_hash} does not load: {exc}"
                ) from None
            self._tokenizers[tokenizer_hash] = info
        return info

    async def _get(self, name: str) -> bytes | None:
        try:
            value = await retry("grammar load", lambda: self.redis.get(name), self.redis_retry_s)
        except (BusUnavailable, RedisError, OSError) as exc:
            raise GrammarUnavailable(f"the grammar cache is unreachable: {exc}") from None
        return value.encode() if isinstance(value, str) else value


def _deserialize(compiled: str, tokenizer: Any) -> CompiledGrammar:
    import xgrammar as xgr

    return xgr.CompiledGrammar.deserialize_json(compiled, tokenizer)


def _deserialize_tokenizer(raw: bytes) -> Any:
    import xgrammar as xgr

    return xgr.TokenizerInfo.deserialize_json(raw.decode())
