"""The grammar service against a real Redis, called over the bus: compile calls, caches, limits,
garbage on its calls stream, the scheduler's view.

One service per module (its start loads the tokenizer and forks compilers). A compiled key
must be loadable by the scheduler's GrammarLoader straight from Redis: that is the contract
between the two services, so it is checked with a real matcher on real model tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from services.scheduler.structured_output.grammar_loader import GrammarLoader, GrammarUnavailable
from shared.codec import encode
from shared.grammar_store import GrammarEntry, GrammarKeys
from shared.protocol import AbortRequest, CompileGrammar
from shared.rpc import RpcError
from shared.streams import Streams
from tests.support.grammar_server import RunningGrammarService, grammar_service
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

COMPILE_TIMEOUT_S = 2.0
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
#: Compiles fast, but its serialization grows past any sane time/memory budget (measured).
PATHOLOGICAL = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string"} for i in range(2000)},
    "required": [f"p{i}" for i in range(2000)],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grammar(
    redis_server: RedisServer, smollm2_dir: Path
) -> AsyncIterator[RunningGrammarService]:
    async with grammar_service(
        redis_server.url,
        smollm2_dir,
        cluster="gtest",
        compile_timeout_s=COMPILE_TIMEOUT_S,
        compile_workers=1,
        cache_entries=4,
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


KEYS = GrammarKeys("gtest")


def matches(grammar: Any, tokenizer: Any, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.is_completed()


@pytest.mark.parametrize(
    ("kind", "spec", "good", "bad"),
    [
        ("json_schema", json.dumps(SCHEMA), '{"n": 42}', '{"n": "x"}'),
        ("json_object", "", '{"a": [1, null]}', "[1]"),
        ("regex", r"[0-9]{3}-[a-z]+", "123-abc", "12-abc"),
        ("choice", json.dumps(["red", "green"]), "green", "blue"),
        ("grammar", 'root ::= "yes" | "no"', "no", "maybe"),
        ("grammar", 'start: "yes" | "no"', "yes", "maybe"),  # Lark
        (
            "structural_tag",
            json.dumps(
                {
                    "structures": [
                        {"begin": "<f>", "schema": SCHEMA, "end": "</f>"},
                    ],
                    "triggers": ["<f>"],
                }
            ),
            'hi <f>{"n": 1}</f>',
            'hi <f>{"n": "x"}</f>',
        ),
    ],
)
async def test_every_kind_compiles_into_redis_where_the_scheduler_loads_it(
    grammar: RunningGrammarService,
    redis: aioredis.Redis,
    tokenizer: Any,
    kind: str,
    spec: str,
    good: str,
    bad: str,
) -> None:
    reply = await grammar.compile(kind, spec)
    key = reply.key
    entry = GrammarEntry.decode(await redis.get(KEYS.grammar(key)))
    assert entry.kind == kind == reply.kind and entry.tokenizer_hash == reply.tokenizer_hash
    assert await redis.ttl(KEYS.grammar(key)) > 0  # bounded lifetime, refreshed on use

    loaded = await GrammarLoader(redis, KEYS).load(key)  # what the scheduler does
    assert loaded.tokenizer_info.vocab_size == 49152  # covers every logit of the model
    assert matches(loaded, tokenizer, good)
    assert not matches(loaded, tokenizer, bad)


async def metric(grammar: RunningGrammarService, name: str) -> float:
    for line in (await grammar.http.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def test_the_same_spec_is_compiled_once(grammar: RunningGrammarService) -> None:
    spec = json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 3})
    misses = await metric(grammar, "meshllm:grammar_cache_misses_total")
    compiles = await metric(grammar, "meshllm:grammar_compile_seconds_count")
    replies = await asyncio.gather(*(grammar.compile("json_schema", spec) for _ in range(4)))
    assert len({r.key for r in replies}) == 1
    assert await metric(grammar, "meshllm:grammar_cache_misses_total") == misses + 1
    assert await metric(grammar, "meshllm:grammar_compile_seconds_count") == compiles + 1
    hits = await metric(grammar, 'meshllm:grammar_cache_hits_total{tier="memory"}')
    again = await grammar.compile("json_schema", spec)
    assert again.source == "memory" and again.cached and again.key == replies[0].key
    assert await metric(grammar, 'meshllm:grammar_cache_hits_total{tier="memory"}') == hits + 1


async def test_redis_is_the_second_tier_and_is_refilled_when_it_lost_an_entry(
    grammar: RunningGrammarService, redis: aioredis.Redis
) -> None:
    spec = r"[a-f]{4}"
    key = (await grammar.compile("regex", spec)).key
    assert grammar.service.cache is not None
    grammar.service.cache._memory.clear()  # a replica that never saw it: Redis answers
    assert (await grammar.compile("regex", spec)).source == "redis"

    # Redis restarted empty: the service recreates its calls stream at once (until then calls
    # are unavailable), and the memory hit writes everything back.
    await redis.flushall()
    while not await redis.exists(grammar.stream):
        await asyncio.sleep(0.01)
    reply = await grammar.compile("regex", spec)
    assert reply.source == "memory" and reply.key == key
    assert await redis.exists(KEYS.grammar(key), KEYS.tokenizer(reply.tokenizer_hash)) == 2
    assert await GrammarLoader(redis, KEYS).load(key) is not None


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", '{"type": "string", "pattern": "[a-"}', "Unclosed"),
        ("json_schema", '{"$ref": "#/definitions/missing"}', "definitions"),
        ("json_schema", '{"type": "array", "uniqueItems": true}', "unsupported"),
        ("regex", "a(b", "parenthesis"),
        ("regex", "(?<=a)b", "Lookbehind"),
        ("choice", "[]", "must not be empty"),
        ("grammar", "root ::= undefined_rule", "not defined"),
        ("grammar", "start: unknown", "unknown"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', ""),
    ],
)
async def test_invalid_specs_are_refused_with_the_reason(
    grammar: RunningGrammarService, kind: str, spec: str, message: str
) -> None:
    with pytest.raises(RpcError) as refused:
        await grammar.compile(kind, spec)
    assert refused.value.kind == "bad_request"  # the gateway's 400
    assert message in refused.value.message and "project/cpp" not in refused.value.message


async def test_garbage_calls_are_dead_lettered_and_the_service_keeps_answering(
    grammar: RunningGrammarService, redis: aioredis.Redis
) -> None:
    """Undecodable bytes, a kind the protocol does not know, a call answering elsewhere than
    the rpc reply namespace, a message that is no call: each goes to the dead letters."""
    streams = Streams("gtest")
    calls = streams.calls("grammar")
    dead_before = await redis.xlen(streams.deadletter)
    unknown_kind = {"t": CompileGrammar.TYPE, "v": 1, "b": {"kind": "sql", "spec": "SELECT 1"}}
    stray = CompileGrammar(
        kind="regex",
        spec="a",
        correlation_id="c",
        reply_stream="meshllm:gtest:requests",
        deadline=time.time() + 60,
    )
    for payload in (
        b"{not msgpack",
        msgpack.packb(unknown_kind),
        encode(stray),
        encode(AbortRequest(request_id="not a call")),
    ):
        await redis.xadd(calls, {"m": payload})
    assert (await grammar.compile("regex", "[0-9]{2}")).key  # still answering, in order
    records = await redis.xrange(streams.deadletter)
    reasons = [fields[b"reason"] for _, fields in records[dead_before:]]
    assert reasons == [b"malformed", b"invalid", b"bad_envelope", b"bad_envelope"]
    assert b"grammar_compile.kind" in records[dead_before + 1][1][b"detail"]
    assert not await redis.exists("meshllm:gtest:requests")


@pytest.mark.parametrize("kind", ["json_schema", "structural_tag"])
async def test_a_deeply_nested_spec_is_a_400_not_a_500(
    grammar: RunningGrammarService, kind: str
) -> None:
    """300 levels (an operator's fuzz case) and 50,000 (past Python's recursion limit)."""
    for levels in (300, 50_000):
        spec = '{"type": "object", "properties": {"a": ' * levels + "{}" + "}}" * levels
        with pytest.raises(RpcError, match="levels deep") as refused:
            await grammar.compile(kind, spec)
        assert refused.value.kind == "bad_request"  # the gateway's 400
    assert (await grammar.compile("json_schema", json.dumps(SCHEMA))).key


async def test_a_pathological_spec_is_refused_and_the_service_keeps_answering(
    grammar: RunningGrammarService,
) -> None:
    spec = json.dumps(PATHOLOGICAL)
    with pytest.raises(RpcError, match="could not be compiled") as refused:
        await grammar.compile("json_schema", spec)
    assert refused.value.kind == "bad_request"
    # Its process was replaced: the service compiles the next spec.
    assert (await grammar.compile("regex", "[0-9]{5}")).key
    # Sent again, it is refused at once instead of occupying a compiler for another limit.
    replacements = grammar.service.pool.replacements if grammar.service.pool else -1
    with pytest.raises(RpcError, match="could not be compiled"):
        await grammar.compile("json_schema", spec)
    assert grammar.service.pool is not None and grammar.service.pool.replacements == replacements


async def test_the_loader_explains_missing_keys(redis: aioredis.Redis) -> None:
    loader = GrammarLoader(redis, KEYS)
    with pytest.raises(GrammarUnavailable, match="not in the grammar cache"):
        await loader.load("0" * 64)
    with pytest.raises(GrammarUnavailable, match="no key"):
        await loader.load("")
