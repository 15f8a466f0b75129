"""/tokenize, /detokenize and /v1/models answer from the real tokenizer (vLLM's shapes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.gateway.api.protocol_openai import ChatMessage
from services.gateway.plan.tokenization import PromptTokenizer
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness, gateway_harness

pytestmark = pytest.mark.harness(max_model_len=2048)


async def test_tokenize_prompt_and_roundtrip(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    text = "Héllo wörld 😀"
    resp = await gateway.http.post(
        "/tokenize", json={"model": MODEL_NAME, "prompt": text, "return_token_strs": True}
    )
    body = resp.json()
    assert body["tokens"] == tokenizer.hf(text)["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert body["token_strs"] == tokenizer.hf.convert_ids_to_tokens(body["tokens"])
    back = await gateway.http.post(
        "/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]}
    )
    assert back.json() == {"prompt": text}


async def test_tokenize_messages_uses_the_chat_template(
    gateway: GatewayHarness, tokenizer: PromptTokenizer
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    resp = await gateway.http.post("/tokenize", json={"messages": messages})
    expected = tokenizer.chat_prompt([ChatMessage.model_validate(m) for m in messages])
    assert resp.json()["tokens"] == expected.token_ids
    assert resp.json()["token_strs"] is None


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ],
)
async def test_bad_tokenize_bodies(
    gateway: GatewayHarness, path: str, body: dict, param: str | None
) -> None:
    resp = await gateway.http.post(path, json=body)
    assert resp.status_code in (400, 404)
    assert resp.json()["error"]["param"] == param


async def test_models_lists_the_served_model(gateway: GatewayHarness) -> None:
    body = (await gateway.http.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [
        (MODEL_NAME, "model", 2048)
    ]


#: A template with a variable of its own, as Qwen3's has `enable_thinking`.
GREETING_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if greeting is defined %} {{ greeting }}{% endif %}"
)


async def test_chat_template_kwargs_reach_the_template(redis_url: str, smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.chat_template = GREETING_TEMPLATE
    tok = PromptTokenizer(hf)
    async with gateway_harness(redis_url, tok, smollm2_dir) as gw:
        messages = [{"role": "user", "content": "Hi"}]
        kwargs = {"chat_template_kwargs": {"greeting": "Bonjour"}}
        body = {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": False}
        plain = (await gw.http.post("/tokenize", json=body)).json()["tokens"]
        greeted = (await gw.http.post("/tokenize", json={**body, **kwargs})).json()["tokens"]
        assert (tok.decode(plain), tok.decode(greeted)) == ("Hi", "Hi Bonjour")
        chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, **kwargs}
        posted = asyncio.create_task(gw.http.post("/v1/chat/completions", json=chat))
        submit = await gw.next_submit()
        assert tok.decode(submit.prompt_token_ids) == "Hi Bonjour"
        posted.cancel()


#: gpt-oss's templates read `reasoning_effort`; this one only says it.
EFFORT_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if reasoning_effort is defined %} effort={{ reasoning_effort }}{% endif %}"
)


async def test_reasoning_effort_reaches_the_template(redis_url: str, smollm2_dir: Path) -> None:
    """As vLLM passes it: chat's reasoning_effort and Responses' reasoning.effort become the
    template's `reasoning_effort`; chat_template_kwargs, when it sets that variable, wins."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.chat_template = EFFORT_TEMPLATE
    tok = PromptTokenizer(hf)
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
    bodies = [
        ("/v1/chat/completions", chat, "Hi"),
        ("/v1/chat/completions", {**chat, "reasoning_effort": "low"}, "Hi effort=low"),
        (
            "/v1/chat/completions",
            {**chat, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "x"}},
            "Hi effort=x",
        ),
        ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "high"}}, "Hi effort=high"),
        ("/v1/responses", {"input": "Hi", "reasoning": {"summary": "auto"}}, "Hi"),
    ]
    async with gateway_harness(redis_url, tok, smollm2_dir) as gw:
        for path, body, prompt in bodies:
            posted = asyncio.create_task(gw.http.post(path, json=body))
            submit = await gw.next_submit()
            assert tok.decode(submit.prompt_token_ids) == prompt, body
            await gw.reply_tokens(submit, [11], "length")
            assert (await posted).status_code == 200
