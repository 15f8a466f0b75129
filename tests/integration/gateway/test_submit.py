"""What a valid request puts on the requests stream: the right tokens and every parameter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.api.protocol_openai import ChatMessage
from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta, SubmitRequest
from tests.support.grammar_server import grammar_service
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness, gateway_harness


async def submitted(
    gw: GatewayHarness, path: str, body: dict[str, Any], count: int = 1
) -> tuple[list[SubmitRequest], asyncio.Task[httpx.Response]]:
    task = asyncio.create_task(gw.http.post(path, json={"model": MODEL_NAME, **body}))
    return [await gw.next_submit() for _ in range(count)], task


async def finish(gw: GatewayHarness, subs: list[SubmitRequest]) -> None:
    """Finish each request with one token, with logprobs when it asked for them."""

    def delta(sub: SubmitRequest) -> RequestDelta:
        k = sub.sampling.logprobs
        extra: dict[str, Any] = {}
        if k is not None:
            extra = (
                {"logprobs": [-0.5], "top_token_ids": list(range(k)), "top_logprobs": [-1.0] * k}
                if k
                else {"logprobs": [-0.5]}
            )
        return RequestDelta(
            request_id=sub.request_id,
            start_index=0,
            token_ids=[42],
            finish_reason="length",
            **extra,
        )

    await gw.reply(*(delta(s) for s in subs))


async def test_completion_params_reach_the_stream(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 1234,
        "stop_token_ids": [13, 198],
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"42": -100, "7": 2.5},
        "ignore_eos": True,
        "min_tokens": 3,
        "logprobs": 2,
        "user": "alice",
    }
    (sub,), task = await submitted(gateway, "/v1/completions", body)
    assert sub.prompt_token_ids == tokenizer.encode("The capital of France is")
    assert sub.reply_stream == gateway.streams.replies("gw-test")
    assert sub.request_id.startswith("cmpl-") and sub.request_id.endswith("-0")
    s = sub.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k) == (7, 0.7, 0.9, 40)
    assert (s.min_p, s.seed, s.stop_token_ids) == (0.05, 1234, [13, 198])
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.logit_bias == {42: -100.0, 7: 2.5}
    assert (s.ignore_eos, s.min_tokens, s.logprobs) == (True, 3, 2)
    assert sub.grammar is None and not sub.return_routed_experts
    await finish(gateway, [sub])
    assert (await task).status_code == 200


async def test_defaults_follow_openai(gateway: GatewayHarness) -> None:
    (sub,), task = await submitted(gateway, "/v1/completions", {"prompt": "Hi"})
    s = sub.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (
        16,
        1.0,
        1.0,
        0,
        1.0,
    )
    assert s.logprobs is None and s.stop_token_ids == [] and s.logit_bias == {}
    await finish(gateway, [sub])
    await task


async def test_chat_prompt_is_the_templated_conversation(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]},
    ]
    (sub,), task = await submitted(
        gateway,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    expected = tokenizer.chat_prompt([ChatMessage.model_validate(m) for m in messages])
    assert sub.prompt_token_ids == expected.token_ids
    assert sub.request_id.startswith("chatcmpl-")
    assert sub.sampling.max_tokens == 5 and sub.sampling.logprobs == 3
    await finish(gateway, [sub])
    await task


async def test_chat_without_max_tokens_may_use_the_rest_of_the_context(
    gateway: GatewayHarness,
) -> None:
    (sub,), task = await submitted(
        gateway, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert sub.sampling.max_tokens == gateway.model.max_model_len - len(sub.prompt_token_ids)
    await finish(gateway, [sub])
    await task


async def test_n_choices_get_suffixed_ids_and_consecutive_seeds(gateway: GatewayHarness) -> None:
    subs, task = await submitted(
        gateway, "/v1/completions", {"prompt": "Hi", "n": 3, "seed": 77}, count=3
    )
    base = subs[0].request_id.rsplit("-", 1)[0]
    assert [s.request_id for s in subs] == [f"{base}-{i}" for i in range(3)]
    assert [s.sampling.seed for s in subs] == [77, 78, 79]
    await finish(gateway, subs)
    body = (await task).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]


async def test_seed_is_drawn_when_the_client_gives_none(gateway: GatewayHarness) -> None:
    subs, task = await submitted(gateway, "/v1/completions", {"prompt": "Hi", "n": 2}, count=2)
    first, second = (s.sampling.seed for s in subs)
    assert second == first + 1 and 0 <= first < 2**63
    await finish(gateway, subs)
    await task
    subs2, task2 = await submitted(gateway, "/v1/completions", {"prompt": "Hi"})
    assert subs2[0].sampling.seed != first  # drawn afresh (2**-63 chance of a false failure)
    await finish(gateway, subs2)
    await task2


async def test_several_prompts_each_with_n_choices(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode("Token prompt")
    subs, task = await submitted(
        gateway, "/v1/completions", {"prompt": [ids, ids[:2]], "n": 2, "seed": 5}, count=4
    )
    assert [s.prompt_token_ids for s in subs] == [ids, ids, ids[:2], ids[:2]]
    assert [s.sampling.seed for s in subs] == [5, 6, 5, 6]  # same prompt + seed -> same choice
    await finish(gateway, subs)
    body = (await task).json()
    assert body["usage"]["prompt_tokens"] == len(ids) + 2  # each prompt once, not per choice
    assert body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("extra", "kind", "spec"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "city",
                        "schema": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string"},
                                "country": {"type": "string"},
                            },
                        },
                    },
                }
            },
            "json_schema",
            '{"type": "object", "properties": {"name": {"type": "string"}, '
            '"country": {"type": "string"}}}',
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        (
            {"structured_outputs": {"json": '{"type": "integer"}'}},
            "json_schema",
            '{"type": "integer"}',
        ),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
async def test_structured_output_specs_travel_as_grammar_refs(
    redis_url: str,
    tokenizer: PromptTokenizer,
    smollm2_dir: Path,
    extra: dict[str, Any],
    kind: str | None,
    spec: str | None,
) -> None:
    """The gateway compiles the spec with the (real) grammar service before queuing, and the
    request carries the spec and the compiled grammar's cache key."""
    async with (
        grammar_service(redis_url, smollm2_dir),
        gateway_harness(redis_url, tokenizer, smollm2_dir) as gateway,
    ):
        (sub,), task = await submitted(
            gateway,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra},
        )
        if kind is None:
            assert sub.grammar is None
        else:
            assert sub.grammar is not None and sub.grammar.kind == kind
            assert sub.grammar.spec == spec
            assert sub.grammar.key  # compiled and cached under this key
            if kind == "json_schema":
                json.loads(sub.grammar.spec)  # property order kept, still valid JSON
        await finish(gateway, [sub])
        await task
