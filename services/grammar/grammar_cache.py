"""Compiled grammars by key: memory (bounded LRU), then Redis, then the compiler pool.

Invariants:
- Every key this returns is in Redis, with the tokenizer info it needs, when the call returns:
  the gateway puts the key on the bus right after, and a scheduler reads it from Redis. Every
  path (memory hit, Redis hit, fresh compile) therefore refreshes the entry's TTL, rewrites it
  when Redis lost it (evicted, or Redis restarted empty) and rewrites the tokenizer info when
  that is gone; `keep_tokenizer` also re-publishes the tokenizer info within a beat of a Redis
  restart, before any request asks.
- A Redis command that meets a dead connection (a restarted Redis leaves every pooled one dead)
  is retried on a fresh one for up to STORE_RETRY_S before the caller gets a 503.
- One compilation per key at a time: concurrent requests for one spec share it (single
  flight), and a caller that goes away does not cancel it for the others.
- A spec that failed is remembered (bounded) and refused at once, so a pathological spec sent
  again does not occupy a compiler process for another time limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

from prometheus_client import Counter, Histogram
from redis.exceptions import RedisError

from services.grammar.compiler_pool import CompilerPool
from services.grammar.compiler_process import CompileError
from services.grammar.grammar_spec import CompileJob, GrammarSpecError, compile_job, grammar_key
from services.grammar.tokenizer_identity import TokenizerIdentity
from shared.bus_retry import BusUnavailable, retry
from shared.grammar_store import GrammarEntry, GrammarEntryError, GrammarKeys
from shared.metrics import metric_name

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

COMPILE_SECONDS = Histogram(
    metric_name("grammar_compile_seconds"),
    "Time to compile and serialize one grammar (in the compiler process)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CACHE_HITS = Counter(
    metric_name("grammar_cache_hits"), "Grammar requests served from a cache", ["tier"]
)
CACHE_MISSES = Counter(metric_name("grammar_cache_misses"), "Grammar requests that compiled")
COMPILE_FAILURES = Counter(
    metric_name("grammar_compile_failures"), "Grammar specs refused (invalid, too slow, too big)"
)

FAILURES_REMEMBERED = 1024
STORE_RETRY_S = 3.0
T = TypeVar("T")

Source = Literal["memory", "redis", "compiled"]


class GrammarRefused(Exception):
    """The spec is invalid or cannot be compiled within the limits (HTTP 400)."""


class GrammarStoreUnavailable(Exception):
    """Redis cannot be reached, so no key can be handed out (HTTP 503)."""


@dataclass(frozen=True)
class GrammarInfo:
    key: str
    kind: str
    source: Source
    compiled_bytes: int
    compile_seconds: float = 0.0


class GrammarCache:
    def __init__(
        self,
        redis: Redis,
        keys: GrammarKeys,
        pool: CompilerPool,
        tokenizer: TokenizerIdentity,
        *,
        entries: int = 512,
        ttl_s: int = 7 * 86400,
        compile_timeout_s: float = 10.0,
        max_compiled_bytes: int = 64 * 2**20,
        json_any_whitespace: bool = False,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.pool = pool
        self.tokenizer = tokenizer
        self.entries = max(1, entries)
        self.ttl_s = ttl_s
        self.compile_timeout_s = compile_timeout_s
        self.max_compiled_bytes = max_compiled_bytes
        self.json_any_whitespace = json_any_whitespace
        self._memory: OrderedDict[str, GrammarEntry] = OrderedDict()
        self._failures: OrderedDict[str, str] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[GrammarInfo]] = {}

    @property
    def num_entries(self) -> int:
        return len(self._memory)

    async def publish_tokenizer(self) -> None:
        name, info = self.keys.tokenizer(self.tokenizer.hash), self.tokenizer.info_json
        await self._redis(lambda: self.redis.set(name, info))

    async def keep_tokenizer(self, stop: asyncio.Event, interval_s: float) -> None:
        """Until `stop`: every `interval_s`, re-publish the tokenizer info if Redis lost it
        (a restart without persistence), so schedulers can load grammars again at once."""
        name = self.keys.tokenizer(self.tokenizer.hash)
        while not stop.is_set():
            try:
                if not await self._redis(lambda: self.redis.exists(name)):
                    await self.publish_tokenizer()
                    log.info("tokenizer info re-published (Redis had lost it)")
            except GrammarStoreUnavailable as exc:
                log.warning("tokenizer info not checked: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    async def get(self, kind: str, spec: str) -> GrammarInfo:
        """The key of (kind, spec) compiled for the served tokenizer, stored in Redis.
        Raises GrammarRefused (400) or GrammarStoreUnavailable (503)."""
        try:
            job = compile_job(kind, spec, json_any_whitespace=self.json_any_whitespace)
        except GrammarSpecError as exc:
            COMPILE_FAILURES.inc()
            raise GrammarRefused(str(exc)) from None
        key = grammar_key(job, kind, spec, self.tokenizer.hash, self.tokenizer.xgrammar_version)
        if key in self._failures:
            self._failures.move_to_end(key)
            raise GrammarRefused(self._failures[key])
        entry = self._memory.get(key)
        if entry is not None:
            self._memory.move_to_end(key)
            await self._ensure_stored(key, entry)
            CACHE_HITS.labels("memory").inc()
            return GrammarInfo(key, kind, "memory", len(entry.compiled))
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.create_task(self._load_or_compile(key, kind, job))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(task)

    async def _load_or_compile(self, key: str, kind: str, job: CompileJob) -> GrammarInfo:
        stored = await self._redis(lambda: self.redis.get(self.keys.grammar(key)))
        if isinstance(stored, str):  # a client built with decode_responses
            stored = stored.encode()
        if stored is not None:
            entry = self._usable(stored)
            if entry is not None:
                self._remember(key, entry)
                await self._ensure_stored(key, entry)
                CACHE_HITS.labels("redis").inc()
                return GrammarInfo(key, kind, "redis", len(entry.compiled))
        CACHE_MISSES.inc()
        try:
            compiled = await self.pool.compile(job, self.compile_timeout_s)
        except CompileError as exc:
            self._refuse(key, str(exc))
        COMPILE_SECONDS.observe(compiled.seconds)
        if len(compiled.serialized) > self.max_compiled_bytes:
            self._refuse(
                key,
                f"the compiled grammar takes {len(compiled.serialized)} bytes, more than the "
                f"{self.max_compiled_bytes} allowed; simplify the spec",
            )
        entry = GrammarEntry(
            kind, compiled.serialized, self.tokenizer.hash, self.tokenizer.xgrammar_version
        )
        self._remember(key, entry)
        await self._ensure_stored(key, entry, written=False)
        return GrammarInfo(key, kind, "compiled", len(entry.compiled), compiled.seconds)

    def _usable(self, raw: bytes) -> GrammarEntry | None:
        try:
            entry = GrammarEntry.decode(raw)
        except GrammarEntryError as exc:
            log.warning("ignoring an unreadable grammar cache entry: %s", exc)
            return None
        same = (entry.tokenizer_hash, entry.xgrammar_version) == (
            self.tokenizer.hash,
            self.tokenizer.xgrammar_version,
        )
        return entry if same else None

    def _remember(self, key: str, entry: GrammarEntry) -> None:
        self._memory[key] = entry
        self._memory.move_to_end(key)
        while len(self._memory) > self.entries:
            self._memory.popitem(last=False)

    def _refuse(self, key: str, message: str) -> NoReturn:
        COMPILE_FAILURES.inc()
        self._failures[key] = message
        while len(self._failures) > FAILURES_REMEMBERED:
            self._failures.popitem(last=False)
        raise GrammarRefused(message)

    async def _ensure_stored(self, key: str, entry: GrammarEntry, written: bool = True) -> None:
        """Refresh the TTL; rewrite the entry (and the tokenizer info) if Redis lost them.
        `written=False`: the entry is new, write it."""
        grammar_key_name = self.keys.grammar(key)
        tokenizer_key_name = self.keys.tokenizer(self.tokenizer.hash)

        async def check() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.expire(grammar_key_name, self.ttl_s)
            pipe.exists(tokenizer_key_name)
            return await pipe.execute()

        grammar_present, tokenizer_present = await self._redis(check)
        if not (written and grammar_present):
            data = entry.encode()
            await self._redis(lambda: self.redis.set(grammar_key_name, data, ex=self.ttl_s))
        if not tokenizer_present:
            await self.publish_tokenizer()

    @staticmethod
    async def _redis(op: Callable[[], Awaitable[T]]) -> T:
        try:
            return await retry("grammar cache", op, STORE_RETRY_S)
        except (BusUnavailable, RedisError, OSError) as exc:
            raise GrammarStoreUnavailable(f"Redis is unreachable: {exc}") from None
