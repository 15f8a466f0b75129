"""Structured outputs heal by themselves after Redis restarts empty (no persistence): the grammar
service re-publishes its tokenizer info, and a scheduler that finds it missing waits for it a
bounded time instead of failing the request at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from services.scheduler.structured_output.grammar_loader import GrammarLoader, GrammarUnavailable
from shared.grammar_store import GrammarKeys
from tests.integration.shared.test_bus import eventually
from tests.support.grammar_server import RunningGrammarService, grammar_service
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = GrammarKeys("gheal")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def redis_server() -> AsyncIterator[RedisServer]:  # type: ignore[misc]
    server = RedisServer().start()
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grammar(
    redis_server: RedisServer, smollm2_dir: Path
) -> AsyncIterator[RunningGrammarService]:
    async with grammar_service(
        redis_server.url, smollm2_dir, cluster="gheal", compile_workers=1
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def tokenizer_key(grammar: RunningGrammarService) -> str:
    assert grammar.service.cache is not None
    return KEYS.tokenizer(grammar.service.cache.tokenizer.hash)


async def test_a_restarted_empty_redis_gets_the_tokenizer_info_back_and_grammars_load(
    grammar: RunningGrammarService, redis_server: RedisServer, redis: aioredis.Redis
) -> None:
    name = tokenizer_key(grammar)
    await eventually(lambda: redis.exists(name), "the tokenizer info at start")
    await asyncio.to_thread(redis_server.restart)  # same port, nothing kept
    after = aioredis.Redis.from_url(redis_server.url)  # the old client's connection is dead
    try:
        await eventually(lambda: after.exists(name), "the tokenizer info re-published", 10)
        # Its calls stream comes back when its read loop next meets the empty Redis (NOGROUP:
        # the group is made again); until then a call is refused as "nobody serves" (503).
        calls = grammar.service.streams.calls("grammar")
        await eventually(lambda: after.exists(calls), "the calls stream made again", 10)
        compiled = await grammar.compile("json_schema", json.dumps(SCHEMA))
        fresh_scheduler = GrammarLoader(after, KEYS)  # knows no tokenizer yet
        loaded = await fresh_scheduler.load(compiled.key)
        assert loaded.tokenizer_info.vocab_size == 49152
    finally:
        await after.aclose()


async def test_a_compile_puts_back_a_tokenizer_info_that_went_missing(
    grammar: RunningGrammarService, redis: aioredis.Redis
) -> None:
    name = tokenizer_key(grammar)
    await redis.delete(name)
    compiled = await grammar.compile("regex", "[a-c]{2}")  # a new spec: compiled, not cached
    assert compiled.key
    assert await redis.exists(name)  # when the key is handed out, its tokenizer is there


async def test_the_loader_waits_for_a_missing_tokenizer_info(
    grammar: RunningGrammarService, redis: aioredis.Redis
) -> None:
    """Against a copy of the entries in a namespace no grammar service keeps, so the test
    decides when the tokenizer info comes back."""
    key = (await grammar.compile("regex", "[x-z]{3}")).key
    elsewhere = GrammarKeys("gwait")
    assert grammar.service.cache is not None
    tokenizer_hash = grammar.service.cache.tokenizer.hash
    await redis.set(elsewhere.grammar(key), await redis.get(KEYS.grammar(key)))
    tokenizer_info = await redis.get(KEYS.tokenizer(tokenizer_hash))

    loading = asyncio.create_task(GrammarLoader(redis, elsewhere, tokenizer_wait_s=30).load(key))
    await asyncio.sleep(0.6)  # a few of its polls: it must still be waiting, not failed
    assert not loading.done()
    await redis.set(elsewhere.tokenizer(tokenizer_hash), tokenizer_info)
    assert (await asyncio.wait_for(loading, 10)).tokenizer_info.vocab_size == 49152

    await redis.delete(elsewhere.tokenizer(tokenizer_hash))
    with pytest.raises(GrammarUnavailable, match="waited"):
        await GrammarLoader(redis, elsewhere, tokenizer_wait_s=0.3).load(key)
