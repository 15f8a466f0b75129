"""One API request in flight: replies in, choice updates out, as one body or as SSE events.

Owns the per-choice assemblers and timers, the request's deadline (its total and progress
bounds, request_deadline.py), and the abort of a choice that a stop string ended (the scheduler
knows only stop tokens). It does not own the handle's lifetime: the HTTP edge calls `close()`
in a `finally`, which aborts whatever still runs (a client that went away, a timeout) and frees
the request's slots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.gateway.api.errors import OpenAIError
from services.gateway.api.responses import (
    DONE,
    chat_body,
    chat_role_chunk,
    completion_body,
    error_event,
    sse,
    update_chunk,
    usage,
    usage_chunk,
)
from services.gateway.metrics import ChoiceTimer
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.bus_client import RequestHandle
from services.gateway.stream.choice_assembler import ChoiceAssembler, ChoiceUpdate
from services.gateway.stream.message_reader import MessageDelta, MessageReader, message_reader
from services.gateway.stream.request_deadline import Bound, RequestDeadline
from shared.protocol import RequestDelta

log = logging.getLogger(__name__)

#: Reasons counted by request_success_total (vLLM's finished reasons); errors are not success.
SUCCESS_REASONS = frozenset({"stop", "length", "abort"})


@dataclass(frozen=True)
class StreamError:
    """A stream's failure: its message, OpenAI error type, HTTP status and error code."""

    message: str
    type: str
    status: int
    code: str | None = None


class RequestTimedOut(Exception):
    def __init__(self, bound: Bound, progress_timeout_s: float) -> None:
        self.bound = bound
        if bound == "progress":
            message = (
                f"no progress for {progress_timeout_s:g} s: the engine produced no token for "
                "this request (the mesh may be overloaded or a worker stuck); it was aborted"
            )
        else:
            message = "the request timed out"
        super().__init__(message)
        self.message = message
        self.code = "progress_timeout" if bound == "progress" else "timeout"

    def error(self) -> OpenAIError:
        return OpenAIError(504, self.message, type_="timeout_error", code=self.code)


class Generation:
    def __init__(
        self,
        handle: RequestHandle,
        tok: PromptTokenizer,
        timeout_s: float,
        arrival: float | None = None,
        progress_timeout_s: float = 0.0,
    ) -> None:
        """`arrival` is the request's `time.monotonic()` at the HTTP edge (for TTFT);
        `timeout_s` bounds the whole request, `progress_timeout_s` (0: off) each wait for its
        next delta, the first one included."""
        self.handle = handle
        self.plan = handle.plan
        self.tok = tok
        plan = self.plan
        self.choices = [
            ChoiceAssembler(
                i,
                tok,
                plan.prompt_of(i).token_ids,
                stop=plan.stop,
                logprobs=plan.logprobs is not None,
                routed_experts=plan.return_routed_experts,
                prompt_logprobs=plan.prompt_logprobs is not None
                or (plan.echo and plan.logprobs is not None),
                include_stop=plan.include_stop,
                skip_special_tokens=plan.skip_special_tokens,
                reasoning=bool(plan.reasoning),
            )
            for i in range(plan.num_choices)
        ]
        self.timers = [
            ChoiceTimer(plan.model, len(plan.prompt_of(i).token_ids), arrival)
            for i in range(plan.num_choices)
        ]
        self.deadline = RequestDeadline(time.monotonic(), timeout_s, progress_timeout_s)
        self.progress_timeout_s = progress_timeout_s
        self.timed_out = False

    def close(self) -> None:
        """Abort what still runs (the client left, or the deadline passed) and count it."""
        for choice in self.choices:
            if not choice.finished:
                self.timers[choice.index].finished("abort", choice.num_tokens)
        self.handle.close("timeout" if self.timed_out else "client")

    async def updates(self) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
        """Choice updates in arrival order until every choice finished; RequestTimedOut past
        either bound of the deadline (`close()` then aborts the request on the scheduler).

        Deltas that were already waiting when the consumer came for the next one (it fell
        behind the engine: a slow client, a busy gateway) become one update per choice, so a
        loaded gateway sends fewer, larger chunks instead of falling further behind (vLLM's
        RequestOutputCollector merges outputs the same way)."""
        running = {c.index for c in self.choices}
        while running:
            try:
                first = await self.handle.next_delta(self.deadline.remaining_s(time.monotonic()))
            except TimeoutError:
                self.timed_out = True
                bound = self.deadline.passed(time.monotonic()) or "progress"
                log.warning(
                    "request %s: %s bound passed, aborting it",
                    self.plan.request_id,
                    bound,
                    extra={"request_id": self.plan.request_id, "bound": bound},
                )
                raise RequestTimedOut(bound, self.progress_timeout_s) from None
            self.deadline.progressed(time.monotonic())
            merged: dict[int, ChoiceUpdate] = {}  # per choice, in order of first arrival
            for index, delta in [first, *self.handle.queued_deltas()]:
                update = self._consume(index, delta, running)
                if update is not None:
                    merged[index] = merged[index].then(update) if index in merged else update
            for index, update in merged.items():
                yield index, update

    def _consume(self, index: int, delta: RequestDelta, running: set[int]) -> ChoiceUpdate | None:
        """One delta into its choice (None when that choice had already finished)."""
        choice = self.choices[index]
        if choice.finished:
            return None
        before = choice.num_tokens
        update = choice.consume(delta)
        self.timers[index].tokens(choice.num_tokens - before)
        if update.stopped_on_string:
            self.handle.abort(index, "stop")  # a no-op when the engine already finished it
        if update.finish_reason is not None:
            running.discard(index)
            if update.finish_reason in SUCCESS_REASONS:
                self.timers[index].finished(update.finish_reason, choice.num_tokens)
        return update

    async def collect(self) -> dict[str, Any]:
        """The whole response body (non-streaming)."""
        try:
            async for _index, update in self.updates():
                if update.error is not None:
                    status, type_ = engine_error_status(update)
                    raise OpenAIError(status, update.error, type_=type_)
        except RequestTimedOut as exc:
            raise exc.error() from None
        if self.plan.kind == "completion":
            return completion_body(self.plan, self.choices, self.tok)
        return chat_body(self.plan, self.choices, self.tok)

    async def stream(self) -> AsyncIterator[str]:
        """SSE events: per choice a first chunk (chat: the role; completions with echo: the
        prompt), content chunks, a chunk with the finish reason; the usage chunk when asked
        for; then `data: [DONE]`. A failure mid-stream (the engine's, a timeout, the gateway
        shutting down) is an error event, then [DONE]."""
        async for chunk in self.chunks():
            if isinstance(chunk, StreamError):
                yield error_event(chunk.message, chunk.type, chunk.status)
            else:
                yield sse(chunk)
        yield DONE

    async def chunks(self) -> AsyncIterator[dict[str, Any] | StreamError]:
        """The stream's chunks in order, as dicts; a failure is a StreamError, the last item.
        Other shapes of a stream (the Responses API's events) are made from these.

        A choice's first chunk goes out with its first update from the engine (its first
        token, or its end), as vLLM's does: sent at once, it would tell a client that measures
        time to first token (`vllm bench serve`, AIPerf) that the prefill took no time."""
        plan = self.plan
        offsets = [0] * plan.num_choices
        opened = [False] * plan.num_choices
        readers = [message_reader(plan.tools, plan.reasoning) for _ in range(plan.num_choices)]
        try:
            async for index, update in self.updates():
                if update.error is not None:
                    status, type_ = engine_error_status(update)
                    yield StreamError(update.error, type_, status)
                    return
                if not opened[index]:
                    opened[index] = True
                    first, offsets[index] = self._first_chunk(index)
                    if first is not None:
                        yield self._with_usage(first, index)
                message, finish_reason = self._read_message(index, readers[index], update)
                said = message if message is not None else update.text
                if not (said or update.logprobs or update.routed_rows or update.finish_reason):
                    continue  # held back (partial character, possible stop string or call)
                chunk, offsets[index] = update_chunk(
                    plan,
                    index,
                    update,
                    self.tok,
                    text_offset=offsets[index],
                    message=message,
                    finish_reason=finish_reason,
                )
                yield self._with_usage(chunk, index)
        except RequestTimedOut as exc:
            yield StreamError(exc.message, "timeout_error", 504, exc.code)
            return
        except OpenAIError as exc:  # failed from the gateway's side (shutting down)
            yield StreamError(exc.message, exc.type, exc.status, exc.code)
            return
        if plan.include_usage:
            yield usage_chunk(plan, self.choices)

    def _with_usage(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        """With continuous usage stats (vLLM's), the chunk carries its choice's usage so far."""
        if self.plan.continuous_usage:
            choice = self.choices[index]
            prompt = len(self.plan.prompt_of(index).token_ids)
            chunk["usage"] = usage(prompt, choice.num_tokens, choice.num_cached_tokens)
        return chunk

    def _read_message(
        self, index: int, reader: MessageReader | None, update: ChoiceUpdate
    ) -> tuple[MessageDelta | None, str | None]:
        """The update's text read for reasoning and tool calls, and the finish reason the calls
        make (None without a reader, or before the choice ends)."""
        if reader is None:
            return None, None
        message = reader.feed(update.text)
        if update.finish_reason is None:
            return message, None
        message = message.then(reader.finish())
        self.choices[index].count_reasoning(reader.reasoning_chars)
        return message, reader.finish_reason(update.finish_reason)

    def _first_chunk(self, index: int) -> tuple[dict[str, Any] | None, int]:
        """A choice's opening chunk (chat: the role; completions with echo: the prompt) and
        the text offset after it; None for a completion without echo."""
        plan = self.plan
        if plan.kind == "chat":
            return chat_role_chunk(plan, index), 0
        if plan.echo:
            return update_chunk(
                plan,
                index,
                ChoiceUpdate(),
                self.tok,
                prefix=plan.prompt_of(index).text,
                prompt=self.choices[index],
            )
        return None, 0


def engine_error_status(update: ChoiceUpdate) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a choice the engine ended with an error: 400
    when the request itself cannot be served (its grammar allows no token), else 500."""
    if update.error_type == "invalid_request_error":
        return 400, "invalid_request_error"
    return 500, "internal_server_error"
