"""vLLM's extra request parameters through the gateway's HTTP path: what reaches the scheduler
(allowed_token_ids, bad_words, truncate_prompt_tokens, prompt_logprobs, cache_salt, priority)
and how the reply is shaped (prompt_logprobs, return_tokens_as_token_ids, skip_special_tokens,
include_stop_str_in_output). The scheduler is scripted with real SmolLM2 token ids; the client
is the `openai` package (its `extra_body`, as a vLLM user sends these)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

EOS = 2
PROMPT = "The capital of France is"


pytestmark = pytest.mark.harness(serve=True, scheduling_policy="priority")


async def test_sampling_extras_reach_the_scheduler(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    extras = {
        "allowed_token_ids": [5, 7, 11],
        "bad_words": ["Paris", " Paris", "New York"],
        "truncate_prompt_tokens": 3,
        "cache_salt": "tenant-a",
        "priority": -7,
    }
    task = asyncio.create_task(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2, echo=True, extra_body=extras
        )
    )
    sub = await gateway.next_submit()
    full = tokenizer.encode(PROMPT)
    assert sub.prompt_token_ids == full[-3:]
    assert sub.sampling.allowed_token_ids == [5, 7, 11]
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    words += [tokenizer.encode(w, add_special_tokens=False) for w in ("New York", " New York")]
    assert sub.sampling.bad_words_token_ids == words  # " Paris" is "Paris" again: once
    assert sub.cache_salt == "tenant-a" and sub.priority == -7
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id, start_index=0, token_ids=[11, 5], finish_reason="length"
        )
    )
    resp = await task
    # echo gives the truncated prompt: what the model saw
    assert resp.choices[0].text == tokenizer.decode(full[-3:]) + tokenizer.decode([11, 5])
    assert resp.usage is not None and resp.usage.prompt_tokens == 3


async def test_prompt_logprobs_in_vllm_shape(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(PROMPT)
    n = len(ids) - 1
    task = asyncio.create_task(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1}
        )
    )
    sub = await gateway.next_submit()
    assert sub.sampling.prompt_logprobs == 1 and sub.sampling.logprobs is None
    # Prompt token i + 1 has logprob -(i + 1); the best alternative is token 11 or the token
    # itself (odd positions), with rank 1 then.
    tops = [ids[i + 1] if i % 2 else 11 for i in range(n)]
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id,
            start_index=0,
            token_ids=[EOS],
            finish_reason="stop",
            stop_token_id=EOS,
            prompt_logprobs=[-(i + 1.0) for i in range(n)],
            prompt_top_token_ids=tops,
            prompt_top_logprobs=[-0.5 if i % 2 == 0 else -(i + 1.0) for i in range(n)],
            prompt_ranks=[1 if i % 2 else i + 2 for i in range(n)],
        )
    )
    resp = await task
    got = resp.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert got[0] is None and len(got) == len(ids)
    for i, entry in enumerate(got[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == -(i + 1.0)
        assert own["decoded_token"] == tokenizer.token_text(ids[i + 1])
        if i % 2:
            assert list(entry) == [str(ids[i + 1])] and own["rank"] == 1
        else:
            assert own["rank"] == i + 2
            alternative = {"logprob": -0.5, "rank": 1, "decoded_token": tokenizer.token_text(11)}
            assert entry["11"] == alternative

    chat = asyncio.create_task(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            n=2,
            extra_body={"prompt_logprobs": 0, "return_tokens_as_token_ids": True},
        )
    )
    subs = [await gateway.next_submit() for _ in range(2)]
    chat_ids = subs[0].prompt_token_ids
    for sub in subs:
        await gateway.reply(
            RequestDelta(
                request_id=sub.request_id,
                start_index=0,
                token_ids=[EOS],
                finish_reason="stop",
                stop_token_id=EOS,
                prompt_logprobs=[-1.0] * (len(chat_ids) - 1),
                prompt_ranks=[3] * (len(chat_ids) - 1),
            )
        )
    body = (await chat).model_extra or {}
    assert body["prompt_logprobs"][0] is None  # vLLM's place for chat: the body
    assert body["prompt_logprobs"][1:] == [
        {str(t): {"logprob": -1.0, "rank": 3, "decoded_token": f"token_id:{t}"}}
        for t in chat_ids[1:]
    ]


async def test_tokens_named_by_id_and_special_tokens_kept(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode(" Paris", add_special_tokens=False), im_end, EOS]
    task = asyncio.create_task(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Capital of France?"}],
            max_tokens=5,
            logprobs=True,
            top_logprobs=1,
            extra_body={"return_tokens_as_token_ids": True, "skip_special_tokens": False},
        )
    )
    sub = await gateway.next_submit()
    n = len(ids)
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id,
            start_index=0,
            token_ids=ids,
            logprobs=[-0.5] * n,
            top_token_ids=[11] * n,
            top_logprobs=[-0.25] * n,
            finish_reason="stop",
            stop_token_id=EOS,
        )
    )
    resp = await task
    choice = resp.choices[0]
    assert choice.message.content == tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert choice.message.content.endswith("<|im_end|>")
    assert choice.logprobs is not None and choice.logprobs.content is not None
    for item, token in zip(choice.logprobs.content, ids, strict=True):
        assert item.token == f"token_id:{token}"
        assert item.bytes == list(f"token_id:{token}".encode())
        assert item.top_logprobs[0].token == "token_id:11"


async def test_stop_string_kept_in_the_output(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    task = asyncio.create_task(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=10,
            stop=["three"],
            stream=True,
            extra_body={"include_stop_str_in_output": True},
        )
    )
    sub = await gateway.next_submit()
    await gateway.reply(
        *(
            RequestDelta(request_id=sub.request_id, start_index=i, token_ids=[t])
            for i, t in enumerate(ids)
        )
    )
    chunks = [c async for c in await task]
    assert "".join(c.choices[0].text for c in chunks) == " one two three"
    assert chunks[-1].choices[0].finish_reason == "stop"
    abort = await gateway.next_abort()
    assert (abort.request_id, abort.reason) == (sub.request_id, "stop")
