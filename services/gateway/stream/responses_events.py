"""A chat stream's chunks -> the Responses API's stream events (POST /v1/responses, stream).

Events are OpenAI's, each with its `type` and a `sequence_number` counting from 0, sent as
`event: <type>` / `data: <json>` SSE pairs and no [DONE] (the `openai` client types each event
by the `type` in its data). In order: `response.created` and `response.in_progress` at once
(the response exists before its first token), then the output items in the order the model
writes them, each opened (`response.output_item.added`), filled by deltas and closed
(`response.output_item.done`) before the next one opens:
- reasoning (the chat deltas' reasoning_content): a reasoning_text part, with
  `response.reasoning_text.delta` / `.done`;
- a message (content): an output_text part (`response.content_part.added` / `.done`), with
  `response.output_text.delta` / `.done`;
- a function_call per tool call: `response.function_call_arguments.delta` / `.done`.
Then `response.completed`, or `response.incomplete` when the output was cut short, carrying
the whole Response (responses_output.py builds it, as it builds a non-streamed one). A failure
(the chat stream's error) closes the open item, and is an `error` event, then
`response.failed` with what was output until then.

A message that resumes after a tool call is a second message item, as it was written.

A response that is not streamed is built here too, from the same chunks: it is the Response
that response.completed carries (`whole_response`), so the two shapes never differ.

Logprobs (include "message.output_text.logprobs"): a chat chunk's logprobs belong to the text it
carries, or, when the chat stream held that text back (a possible stop string or tool call), to
the text a later chunk carries. They go with the next message text, on its
`response.output_text.delta`. Tokens that became reasoning (with the marker that ends it) or a
tool call are not listed; those left at the end with no text (the stop token) go on a last
delta with no text, as the chat endpoint lists them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.api.responses_api import ResponsesRequest
from services.gateway.api.responses_output import (
    ItemStatus,
    Status,
    function_call_item,
    message_item,
    new_item_id,
    output_text,
    reasoning_item,
    response_object,
    response_usage,
    status_of,
)
from services.gateway.stream.generation import StreamError

ItemKind = Literal["reasoning", "message", "function_call"]
_ID_PREFIX: dict[ItemKind, Literal["rs", "msg", "fc"]] = {
    "reasoning": "rs",
    "message": "msg",
    "function_call": "fc",
}


def event_sse(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, allow_nan=False)
    return f"event: {event['type']}\ndata: {data}\n\n"


@dataclass
class _Item:
    """The output item being written."""

    kind: ItemKind
    id: str
    index: int  # its output_index
    text: str = ""  # the reasoning, the message's text or the call's arguments
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's tokens

    def body(self, status: ItemStatus) -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text, status)
        if self.kind == "message":
            return message_item(self.id, self.text, status, self.logprobs)
        arguments = self.text if status != "in_progress" else ""
        return function_call_item(self.id, self.call_id, self.name, arguments, status)


class ResponseEvents:
    """One response's events, from its chat chunks (one choice, usage last) in order."""

    def __init__(
        self, req: ResponsesRequest, *, response_id: str, created_at: int, model: str
    ) -> None:
        self.req = req
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.output: list[dict[str, Any]] = []  # closed items
        self.current: _Item | None = None
        self.calls: dict[int, _Item] = {}  # by their chat index
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self._logprobs: list[dict[str, Any]] = []  # of tokens whose text is still to come
        self._sequence = 0

    def start(self) -> list[dict[str, Any]]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if self.req.output_logprobs:
                self._logprobs += (choice.get("logprobs") or {}).get("content") or []
                if not delta.get("content") and (
                    delta.get("reasoning_content") or self._in("reasoning")
                ):
                    self._logprobs = []  # the reasoning's tokens, or its end marker's
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for part in delta.get("tool_calls") or []:
                self._logprobs = []  # the call's tokens
                events += self._call_part(part)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The last item closed, and response.completed (or .incomplete)."""
        status, details = status_of(self.finish_reason)
        events: list[dict[str, Any]] = []
        if self.current is None and not self.output:
            events += self._open("message")  # an empty answer is still a message
        if self._logprobs and self._in("message"):
            # Tokens with no text of their own at the end (the stop token): listed, as the
            # chat endpoint lists them, on a delta with no text.
            events += self._text("message", "")
        events += self._close("completed" if status == "completed" else "incomplete")
        usage = response_usage(self.usage)
        response = self._response(status, usage=usage, incomplete_details=details)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=response)]

    def whole_response(self) -> dict[str, Any]:
        """The finished Response (what finish's last event carries), for a request that was not
        streamed."""
        response: dict[str, Any] = self.finish()[-1]["response"]
        return response

    def fail(self, error: StreamError) -> list[dict[str, Any]]:
        """The open item closed as cut short, an `error` event, and response.failed."""
        events = self._close("incomplete")
        events.append(self._event("error", code=error.type, message=error.message, param=None))
        # OpenAI's codes: a request that cannot be served (400) is an invalid prompt.
        code = "invalid_prompt" if error.status == 400 else "server_error"
        failure = {"code": code, "message": error.message}
        events.append(
            self._event("response.failed", response=self._response("failed", error=failure))
        )
        return events

    # --- items ------------------------------------------------------------------------------

    def _in(self, kind: ItemKind) -> bool:
        return self.current is not None and self.current.kind == kind

    def _text(self, kind: ItemKind, text: str) -> list[dict[str, Any]]:
        events = []
        if self.current is None or self.current.kind != kind:
            events += self._close("completed")
            events += self._open(kind)
        item = self.current
        assert item is not None
        item.text += text
        delta_type = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        fields: dict[str, Any] = {"item_id": item.id, "output_index": item.index}
        fields.update(content_index=0, delta=text)
        if kind == "message":
            fields["logprobs"], self._logprobs = self._logprobs, []
            item.logprobs += fields["logprobs"]
        return [*events, self._event(delta_type, **fields)]

    def _call_part(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call part: the first part of a call (its id and name) opens its item;
        every part's arguments are a delta of the call it belongs to."""
        events: list[dict[str, Any]] = []
        function = part.get("function") or {}
        if part.get("id"):
            events += self._close("completed")
            events += self._open("function_call", call_id=part["id"], name=function["name"])
            assert self.current is not None
            self.calls[part["index"]] = self.current
        item = self.calls[part["index"]]
        arguments = function.get("arguments") or ""
        if arguments:
            item.text += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.index,
                    delta=arguments,
                )
            )
        return events

    def _open(self, kind: ItemKind, *, call_id: str = "", name: str = "") -> list[dict[str, Any]]:
        index = len(self.output)
        item = _Item(kind, new_item_id(_ID_PREFIX[kind]), index, call_id=call_id, name=name)
        self.current = item
        events = [
            self._event(
                "response.output_item.added", output_index=index, item=item.body("in_progress")
            )
        ]
        part = self._part(item)
        if part is not None:
            events.append(self._event("response.content_part.added", **self._at(item), part=part))
        return events

    def _close(self, status: ItemStatus) -> list[dict[str, Any]]:
        item, self.current = self.current, None
        if item is None:
            return []
        events = []
        if item.kind == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=item.index,
                    arguments=item.text,
                )
            )
        else:
            done: dict[str, Any] = {**self._at(item), "text": item.text}
            if item.kind == "message":
                done["logprobs"] = item.logprobs
                events.append(self._event("response.output_text.done", **done))
            else:
                events.append(self._event("response.reasoning_text.done", **done))
            part = self._part(item)
            events.append(self._event("response.content_part.done", **self._at(item), part=part))
        body = item.body(status)
        self.output.append(body)
        events.append(self._event("response.output_item.done", output_index=item.index, item=body))
        return events

    @staticmethod
    def _part(item: _Item) -> dict[str, Any] | None:
        """The item's content part, with its text so far (a call has none)."""
        if item.kind == "message":
            return output_text(item.text, item.logprobs)
        if item.kind == "reasoning":
            return {"type": "reasoning_text", "text": item.text}
        return None

    @staticmethod
    def _at(item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    # --- the response -----------------------------------------------------------------------

    def _response(
        self,
        status: Status,
        *,
        error: dict[str, Any] | None = None,
        usage: dict[str, Any] | None = None,
        incomplete_details: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return response_object(
            self.req,
            response_id=self.response_id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=list(self.output),
            usage=usage,
            incomplete_details=incomplete_details,
            error=error,
        )

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


async def response_events(
    chunks: AsyncIterator[dict[str, Any] | StreamError], events: ResponseEvents
) -> AsyncIterator[str]:
    """The SSE stream of a response from its chat chunks (Generation.chunks)."""
    for event in events.start():
        yield event_sse(event)
    failed = False
    async for chunk in chunks:  # to its end: a failure is the last chunk
        if isinstance(chunk, StreamError):
            failed = True
            batch = events.fail(chunk)
        else:
            batch = events.feed(chunk)
        for event in batch:
            yield event_sse(event)
    if not failed:
        for event in events.finish():
            yield event_sse(event)
