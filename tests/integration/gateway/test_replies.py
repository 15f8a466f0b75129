"""Replies published as a scheduler would, assembled by the gateway, read by the `openai` client.

The deltas carry real SmolLM2 token ids; every expected text is the tokenizer's decode of those
ids, so the test checks the gateway's assembly (detokenization, stop handling, de-duplication,
usage), not an echo of canned text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from prometheus_client import REGISTRY

from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

EOS = 2
ANSWER = " The capital of France is Paris. Ça va? 😀👍🏽 日本"


pytestmark = pytest.mark.harness(serve=True)


def pieces(request_id: str, ids: list[int], size: int, **last: Any) -> list[RequestDelta]:
    out = []
    for start in range(0, len(ids), size):
        final = start + size >= len(ids)
        out.append(
            RequestDelta(
                request_id=request_id,
                start_index=start,
                token_ids=ids[start : start + size],
                **(last if final else {}),
            )
        )
    return out


def itl_count() -> float:
    labels = {"model_name": MODEL_NAME}
    return REGISTRY.get_sample_value("meshllm:inter_token_latency_seconds_count", labels) or 0.0


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Capital of France?"}]}


async def test_chat_non_streaming_with_a_redelivered_delta(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = [*tokenizer.encode(ANSWER, add_special_tokens=False), EOS]
    task = asyncio.create_task(client.chat.completions.create(**CHAT, max_tokens=100))
    sub = await gateway.next_submit()
    deltas = pieces(sub.request_id, ids, 4, finish_reason="stop", stop_token_id=EOS)
    # A restarted scheduler resends from index 0: the repeat must not duplicate text.
    await gateway.reply(*deltas[:2])
    await gateway.reply(*deltas[:3])
    await gateway.reply(*deltas[2:])
    resp = await task
    assert resp.choices[0].message.content == tokenizer.decode(ids[:-1])
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == len(ids)  # the eos counts, as vLLM counts it
    assert resp.usage.prompt_tokens == len(sub.prompt_token_ids)
    assert resp.usage.total_tokens == len(ids) + len(sub.prompt_token_ids)
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL_NAME
    assert sub.request_id == f"{resp.id}-0"


async def test_chat_streaming_chunks_and_usage(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = [*tokenizer.encode(ANSWER, add_special_tokens=False), EOS]

    async def consume() -> list[Any]:
        stream = await client.chat.completions.create(
            **CHAT, max_tokens=100, stream=True, stream_options={"include_usage": True}
        )
        return [chunk async for chunk in stream]

    itl_before = itl_count()
    task = asyncio.create_task(consume())
    sub = await gateway.next_submit()
    deltas = pieces(sub.request_id, ids, 1, finish_reason="stop", stop_token_id=EOS)
    for i, d in enumerate(deltas):
        await gateway.reply(d)
        if i == 5:
            await gateway.reply(*deltas[3:6])  # re-delivered mid-stream
    chunks = await task
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == tokenizer.decode(ids[:-1])
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])
    # One token per delta: every token after the first has a gap; repeats add none.
    assert itl_count() == itl_before + len(ids) - 1


async def test_the_role_chunk_waits_for_the_first_token(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    """Nothing is streamed before the engine's first token: a client that times its first
    chunk (vllm bench serve, AIPerf) measures the prefill, not the gateway's accept."""
    ids = [*tokenizer.encode(" Paris.", add_special_tokens=False), EOS]
    body = {**CHAT, "max_tokens": 20, "stream": True}
    async with gateway.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        sub = await gateway.next_submit()
        early = asyncio.ensure_future(anext(lines))
        await asyncio.sleep(0.5)  # the request is accepted and waiting for its prefill
        assert not early.done(), f"streamed before any token: {early.result()!r}"
        await gateway.reply(
            *pieces(sub.request_id, ids, 1, finish_reason="stop", stop_token_id=EOS)
        )
        first = await early
        rest = [line async for line in lines]
    events = [
        json.loads(x.removeprefix("data: ")) for x in [first, *rest] if x.startswith("data: {")
    ]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:])
    assert text == tokenizer.decode(ids[:-1])


async def test_deltas_waiting_together_leave_as_one_chunk(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    """A consumer that fell behind the engine finds several deltas waiting: they go out as one
    chunk with all their text and logprobs (vLLM merges outputs the same way), not one chunk
    each, so a loaded gateway does less work per token instead of falling further behind."""
    ids = [*tokenizer.encode(ANSWER, add_special_tokens=False), EOS]
    body = {
        "model": MODEL_NAME, "prompt": "Capital of France?", "max_tokens": 100, "stream": True,
        "logprobs": 1,
    }  # fmt: skip
    async with gateway.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        sub = await gateway.next_submit()
        deltas = pieces(sub.request_id, ids, 3, finish_reason="stop", stop_token_id=EOS)
        for d in deltas:
            d.logprobs = [-0.5 - 0.01 * i for i in range(len(d.token_ids))]
        # The first delta alone, read by the client before the rest arrive: its own chunk.
        await gateway.reply(deltas[0])
        lines = resp.aiter_lines()
        events = (json.loads(x[6:]) async for x in lines if x.startswith("data: {"))
        first = await anext(events)
        # The others in one message: all waiting when the stream's consumer wakes up.
        await gateway.reply(*deltas[1:])
        rest = [event async for event in events]
    assert first["choices"][0]["text"] == tokenizer.decode(ids[:3])
    assert first["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids[:3]]
    assert len(rest) == 1, [e["choices"][0]["text"] for e in rest]
    merged = rest[0]["choices"][0]
    assert merged["text"] == tokenizer.decode(ids[:-1])[len(first["choices"][0]["text"]) :]
    assert merged["finish_reason"] == "stop"
    # Every later token has its logprob, in order (the eos too, as vLLM reports it).
    sent = [lp for d in deltas[1:] for lp in d.logprobs or []]
    assert merged["logprobs"]["token_logprobs"] == pytest.approx(sent, rel=1e-6)


async def test_completion_stream_stop_string_across_deltas_is_cut_and_aborted(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    text = " one two three FIN four five"
    ids = tokenizer.encode(text, add_special_tokens=False)

    async def consume() -> list[Any]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt="Count:", max_tokens=50, stop=["FIN"], stream=True
        )
        return [chunk async for chunk in stream]

    task = asyncio.create_task(consume())
    sub = await gateway.next_submit()
    for d in pieces(sub.request_id, ids, 1):
        await gateway.reply(d)
        if "FIN" in tokenizer.decode(ids[: d.start_index + 1]):
            break
    chunks = await task
    assert "".join(c.choices[0].text for c in chunks) == " one two three "
    assert chunks[-1].choices[0].finish_reason == "stop"
    abort = await gateway.next_abort()
    assert (abort.request_id, abort.reason) == (sub.request_id, "stop")


async def test_completion_echo_and_logprobs_shape(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(" Paris.", add_special_tokens=False)
    n = len(ids)
    task = asyncio.create_task(
        client.completions.create(
            model=MODEL_NAME, prompt="The capital of France is", max_tokens=n, logprobs=2
        )
    )
    sub = await gateway.next_submit()
    top = [t for i in ids for t in (i, 11)]
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id,
            start_index=0,
            token_ids=ids,
            logprobs=[-0.25] * n,
            top_token_ids=top,
            top_logprobs=[-0.25, -float("inf")] * n,
            finish_reason="length",
        )
    )
    resp = await task
    choice = resp.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None
    assert "".join(lp.tokens or []) == choice.text
    assert lp.token_logprobs == [-0.25] * n
    assert lp.text_offset == [len(tokenizer.decode(ids[:i])) for i in range(n)]
    comma = tokenizer.token_text(11)
    assert lp.top_logprobs is not None
    assert all(
        d == {tokenizer.token_text(t): -0.25, comma: -9999.0}
        for d, t in zip(lp.top_logprobs, ids, strict=True)
    )

    echo_task = asyncio.create_task(
        client.completions.create(
            model=MODEL_NAME, prompt="The capital of France is", max_tokens=n, echo=True
        )
    )
    sub = await gateway.next_submit()
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id, start_index=0, token_ids=ids, finish_reason="length"
        )
    )
    echoed = await echo_task
    assert echoed.choices[0].text == "The capital of France is" + tokenizer.decode(ids)


@pytest.mark.parametrize("echo", [True, False])
@pytest.mark.parametrize("keep", [None, 3])
async def test_token_id_prompts_are_echoed_as_their_text(
    gateway: GatewayHarness,
    client: openai.AsyncOpenAI,
    tokenizer: PromptTokenizer,
    echo: bool,
    keep: int | None,
) -> None:
    """A token-id prompt's text is decoded only for echo (truncated first, when asked)."""
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    ids = tokenizer.encode(" Paris.", add_special_tokens=False)
    extra = {} if keep is None else {"truncate_prompt_tokens": keep}
    task = asyncio.create_task(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=len(ids), echo=echo, extra_body=extra
        )
    )
    sub = await gateway.next_submit()
    seen = prompt if keep is None else prompt[-keep:]
    assert sub.prompt_token_ids == seen
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id, start_index=0, token_ids=ids, finish_reason="length"
        )
    )
    text = (await task).choices[0].text
    echoed = tokenizer.decode(seen, skip_special_tokens=False) if echo else ""
    assert text == echoed + tokenizer.decode(ids)


async def test_chat_logprobs_tokens_and_bytes(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(" 😀!", add_special_tokens=False)
    n = len(ids)
    task = asyncio.create_task(
        client.chat.completions.create(**CHAT, max_tokens=n, logprobs=True, top_logprobs=1)
    )
    sub = await gateway.next_submit()
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id,
            start_index=0,
            token_ids=ids,
            logprobs=[-0.5] * n,
            top_token_ids=ids,
            top_logprobs=[-0.5] * n,
            finish_reason="length",
        )
    )
    resp = await task
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == n
    assert b"".join(bytes(c.bytes or []) for c in content).decode() == " 😀!"
    assert all(c.logprob == -0.5 and len(c.top_logprobs) == 1 for c in content)


async def test_n_streamed_choices_assemble_independently(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    answers = [" first answer", " second, longer answer 😀"]
    token_lists = [tokenizer.encode(a, add_special_tokens=False) for a in answers]

    async def consume() -> list[Any]:
        stream = await client.chat.completions.create(**CHAT, max_tokens=20, n=2, stream=True)
        return [chunk async for chunk in stream]

    task = asyncio.create_task(consume())
    subs = [await gateway.next_submit(), await gateway.next_submit()]
    longest = max(len(t) for t in token_lists)
    for i in range(longest):  # interleave the two choices' tokens
        for sub, toks in zip(subs, token_lists, strict=True):
            if i < len(toks):
                last = i == len(toks) - 1
                await gateway.reply(
                    RequestDelta(
                        request_id=sub.request_id,
                        start_index=i,
                        token_ids=[toks[i]],
                        finish_reason="length" if last else None,
                    )
                )
    chunks = await task
    for index, answer in enumerate(answers):
        text = "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == index
        )
        assert text == answer


async def test_engine_error_is_a_500_or_an_error_event(
    gateway: GatewayHarness, client: openai.AsyncOpenAI
) -> None:
    task = asyncio.create_task(client.chat.completions.create(**CHAT, max_tokens=5))
    sub = await gateway.next_submit()
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id, start_index=0, finish_reason="error", error="worker lost"
        )
    )
    with pytest.raises(openai.InternalServerError, match="worker lost"):
        await task

    async with gateway.http.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 5, "stream": True}
    ) as resp:
        sub = await gateway.next_submit()
        await gateway.reply(
            RequestDelta(
                request_id=sub.request_id, start_index=0, finish_reason="error", error="worker lost"
            )
        )
        events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert '"worker lost"' in events[-2] and events[-1] == "data: [DONE]"
