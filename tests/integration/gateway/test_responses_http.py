"""POST /v1/responses through the gateway's HTTP path, spoken to by the `openai` client
(`client.responses.create`, streamed and not, and its `responses.stream` helper, which checks
the events' items against the final response): what reaches the scheduler (the prompt as the
chat template renders the same conversation sent to /v1/chat/completions, the sampling
settings, a grammar) and what comes back (the decoded tokens as `output_text`, usage, status).
The scheduler is scripted with real SmolLM2 token ids; a named tool choice compiles its grammar
in the real grammar service."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseOutputItemAddedEvent,
    ResponseTextDeltaEvent,
)

from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol import RequestDelta, SubmitRequest
from tests.support.grammar_server import grammar_service
from tests.unit.gateway.harness import MODEL_NAME, GatewayHarness

EOS = 2
INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CHAT_TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


pytestmark = pytest.mark.harness(serve=True, tool_call_parser="hermes")


async def reply(
    gw: GatewayHarness, sub: SubmitRequest, ids: list[int], finish: str = "stop"
) -> None:
    """`ids` one a delta, then the end-of-turn token when the request stops."""
    await gw.reply_tokens(sub, ids, finish)


async def chat_prompt(
    gw: GatewayHarness, client: openai.AsyncOpenAI, messages: Any, **fields: Any
) -> list[int]:
    """The prompt the chat endpoint submits for `messages`."""
    task = asyncio.create_task(
        client.chat.completions.create(model=MODEL_NAME, messages=messages, **fields)
    )
    sub = await gw.next_submit()
    await reply(gw, sub, [])
    await task
    return list(sub.prompt_token_ids)


async def test_a_response_is_the_chat_answer_to_the_same_conversation(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    expected = await chat_prompt(gateway, client, messages)
    task = asyncio.create_task(
        client.responses.create(
            model=MODEL_NAME,
            input=QUESTION,
            instructions=INSTRUCTIONS,
            max_output_tokens=20,
            temperature=0.25,
            top_p=0.5,
            metadata={"team": "search"},
            user="user-7",
            store=True,
            extra_body={"top_k": 7, "seed": 11, "repetition_penalty": 1.25},
        )
    )
    sub = await gateway.next_submit()
    assert list(sub.prompt_token_ids) == expected
    sampling = sub.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (20, 0.25, 0.5)
    assert (sampling.top_k, sampling.seed, sampling.repetition_penalty) == (7, 11, 1.25)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    await reply(gateway, sub, ids)
    resp = await task
    assert resp.output_text == tokenizer.decode(ids) == ANSWER
    assert resp.id.startswith("resp_") and resp.status == "completed" and resp.error is None
    assert resp.usage is not None
    assert resp.usage.input_tokens == len(expected)
    assert resp.usage.output_tokens == len(ids) + 1  # the end-of-turn token counts
    assert resp.usage.total_tokens == len(expected) + len(ids) + 1
    assert (resp.instructions, resp.max_output_tokens) == (INSTRUCTIONS, 20)
    assert (resp.temperature, resp.top_p, resp.user) == (0.25, 0.5, "user-7")
    assert resp.metadata == {"team": "search"}
    assert (resp.model_extra or {})["store"] is False

    # The same answer's raw body is a Response under strict validation.
    posted = asyncio.create_task(
        gateway.http.post("/v1/responses", json={"model": MODEL_NAME, "input": QUESTION})
    )
    await reply(gateway, await gateway.next_submit(), ids)
    raw = await posted
    assert raw.status_code == 200, raw.text
    assert Response.model_validate(raw.json()).output_text == ANSWER


async def test_a_streamed_response_says_the_same(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    task = asyncio.create_task(
        client.responses.create(model=MODEL_NAME, input=QUESTION, stream=True)
    )
    sub = await gateway.next_submit()
    await reply(gateway, sub, ids)
    stream = await task
    events = [event async for event in stream]
    assert isinstance(events[0], ResponseCreatedEvent)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert len(deltas) > 3 and "".join(d.delta for d in deltas) == ANSWER
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent)
    assert last.response.output_text == ANSWER
    assert last.response.usage is not None and last.response.usage.output_tokens == len(ids) + 1

    # The client's stream helper assembles the items and checks them against the final one.
    async with client.responses.stream(model=MODEL_NAME, input=QUESTION) as helper:
        await reply(gateway, await gateway.next_submit(), ids)
        final = await helper.get_final_response()
    assert final.output_text == ANSWER and final.status == "completed"


async def test_max_output_tokens_makes_an_incomplete_response(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)[:4]
    task = asyncio.create_task(
        client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4)
    )
    sub = await gateway.next_submit()
    assert sub.sampling.max_tokens == 4
    await reply(gateway, sub, ids, finish="length")
    resp = await task
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == tokenizer.decode(ids)
    assert resp.output[0].type == "message" and resp.output[0].status == "incomplete"

    streaming = asyncio.create_task(
        client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4, stream=True)
    )
    await reply(gateway, await gateway.next_submit(), ids, finish="length")
    events = [event async for event in await streaming]
    last = events[-1]
    assert isinstance(last, ResponseIncompleteEvent)
    assert last.response.output_text == tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is this?"},
                            {"type": "input_image", "image_url": "https://example.com/a.png"},
                        ],
                    }
                ]
            },
            "input[0].content",
        ),
        ({"input": "word " * 10000}, "input"),
        ({"previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
            "text.format.schema",
        ),
    ],
)
async def test_a_400_names_the_responses_field_and_queues_nothing(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "input": QUESTION, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(**body)
    assert caught.value.param == param
    assert "max_completion_tokens" not in caught.value.message
    assert await gateway.entries_added(gateway.streams.requests) == 0


async def test_a_tool_call_and_its_output_go_on_as_the_chat_conversation(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    expected = await chat_prompt(gateway, client, question, tools=CHAT_TOOLS)
    arguments = {"city": "Paris", "unit": "celsius"}
    call_json = json.dumps({"name": "get_weather", "arguments": arguments})
    written = f"<tool_call>\n{call_json}\n</tool_call>"  # hermes: the gateway's parser
    ids = tokenizer.encode(written, add_special_tokens=False)
    task = asyncio.create_task(
        client.responses.create(model=MODEL_NAME, input=question, tools=TOOLS)  # type: ignore[arg-type]
    )
    sub = await gateway.next_submit()
    assert list(sub.prompt_token_ids) == expected
    await reply(gateway, sub, ids)
    resp = await task
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed" and json.loads(call.arguments) == arguments
    assert resp.output_text == ""

    # The call and its output sent back as input: the chat conversation with the same call.
    result = "18 degrees and sunny"
    chat_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.arguments},
    }
    conversation = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    expected = await chat_prompt(gateway, client, conversation, tools=CHAT_TOOLS)
    follow_up: Any = [
        *question,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    streaming = asyncio.create_task(
        client.responses.create(model=MODEL_NAME, input=follow_up, tools=TOOLS, stream=True)
    )
    sub = await gateway.next_submit()
    assert list(sub.prompt_token_ids) == expected
    await reply(gateway, sub, tokenizer.encode("It is sunny.", add_special_tokens=False))
    events = [event async for event in await streaming]
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent)
    assert last.response.output_text == "It is sunny."


async def test_a_named_call_streams_its_arguments(
    redis_url: str,
    smollm2_dir: Path,
    gateway: GatewayHarness,
    client: openai.AsyncOpenAI,
    tokenizer: PromptTokenizer,
) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    ids = tokenizer.encode(arguments, add_special_tokens=False)
    choice: Any = {"type": "function", "name": "get_weather"}
    async with grammar_service(redis_url, smollm2_dir):
        task = asyncio.create_task(
            client.responses.create(
                model=MODEL_NAME, input=QUESTION, tools=TOOLS, tool_choice=choice, stream=True
            )
        )
        sub = await gateway.next_submit()
        assert sub.grammar is not None and sub.grammar.kind == "json_schema"
        assert json.loads(sub.grammar.spec) == WEATHER
        await reply(gateway, sub, ids)
        events = [event async for event in await task]

        fmt: Any = {"type": "json_schema", "name": "weather", "schema": WEATHER}
        whole = asyncio.create_task(
            client.responses.create(model=MODEL_NAME, input=QUESTION, text={"format": fmt})
        )
        sub = await gateway.next_submit()
        assert sub.grammar is not None and sub.grammar.kind == "json_schema"
        assert json.loads(sub.grammar.spec) == WEATHER
        await reply(gateway, sub, ids)
        resp = await whole
    (added,) = [e for e in events if isinstance(e, ResponseOutputItemAddedEvent)]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    assert len(deltas) > 3 and "".join(d.delta for d in deltas) == arguments
    (done,) = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDoneEvent)]
    assert done.arguments == arguments and done.item_id == added.item.id
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent)
    (call,) = last.response.output
    assert call.type == "function_call" and call.arguments == arguments
    assert last.response.tool_choice.type == "function"  # type: ignore[union-attr]
    assert json.loads(resp.output_text) == json.loads(arguments)
    assert resp.text is not None and resp.text.format is not None
    assert resp.text.format.type == "json_schema"


async def test_an_engine_error_fails_the_response(
    gateway: GatewayHarness, client: openai.AsyncOpenAI, tokenizer: PromptTokenizer
) -> None:
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)[:3]

    task = asyncio.create_task(
        client.responses.create(model=MODEL_NAME, input=QUESTION, stream=True)
    )
    sub = await gateway.next_submit()
    for i, token in enumerate(ids):
        delta = RequestDelta(request_id=sub.request_id, start_index=i, token_ids=[token])
        await gateway.reply(delta)
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id,
            start_index=len(ids),
            finish_reason="error",
            error="the worker failed",
        )
    )
    events = [event async for event in await task]
    error, failed = events[-2:]
    assert isinstance(error, ResponseErrorEvent) and error.message == "the worker failed"
    assert isinstance(failed, ResponseFailedEvent)
    assert failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == "server_error"
    assert failed.response.output_text == tokenizer.decode(ids)

    whole = asyncio.create_task(client.responses.create(model=MODEL_NAME, input=QUESTION))
    sub = await gateway.next_submit()
    await gateway.reply(
        RequestDelta(
            request_id=sub.request_id, start_index=0, finish_reason="error", error="it failed"
        )
    )
    with pytest.raises(openai.InternalServerError):
        await whole


async def test_the_route_is_in_the_openapi_document(gateway: GatewayHarness) -> None:
    spec = (await gateway.http.get("/openapi.json")).json()
    body = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    properties = body["schema"]["properties"]
    assert {"input", "instructions", "max_output_tokens", "text", "tools"} <= set(properties)
    assert body["schema"]["required"] == ["input"]
