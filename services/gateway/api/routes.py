"""The OpenAI API routes (HTTP edge). The service adds this router to its admin app.

Every route here is behind the API keys (when set) and answers errors in OpenAI's body shape,
both handled by `OpenAIRoute`, so the router needs no app-level exception handlers. Bodies are
parsed by the gateway's own models (not FastAPI's), so a malformed body is a 400 naming the
field, never a 422.

Generation routes answer in this order: 503 while draining, 400 for a body (or a
structured-output spec) at fault, 503 + Retry-After while no worker group can serve (the client's
own mistake is reported first, and a valid request is refused rather than left waiting), then
the request is queued. /v1/models, /tokenize and /detokenize need no worker group.

Disconnects: a streaming client that goes away cancels the stream (Starlette), whose `finally`
aborts the running choices; a non-streaming request watches the connection while it waits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.responses import Response

from services.gateway.api.body_limits import read_body
from services.gateway.api.errors import OpenAIError, error_body
from services.gateway.api.openapi_bodies import request_body
from services.gateway.api.protocol_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.gateway.api.responses_api import ResponsesRequest, responses_error
from services.gateway.api.responses_output import response_id
from services.gateway.frontend import Frontend
from services.gateway.plan.request_plan import RequestPlan
from services.gateway.stream.generation import Generation, StreamError
from services.gateway.stream.responses_events import ResponseEvents, response_events
from shared.logs import bind_request_id
from shared.stopping import result_or_none

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: nginx's "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED = 499

FrontendGetter = Callable[[], Frontend | None]


def openai_router(get_frontend: FrontendGetter) -> APIRouter:
    """`get_frontend` returns None until the service has loaded the tokenizer (503 until then)."""

    class OpenAIRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                try:
                    frontend = _frontend(get_frontend)
                    frontend.auth.check(request.headers.get("authorization"))
                    return await handler(request)
                except OpenAIError as exc:
                    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
                except Exception:
                    log.exception("unhandled error on %s", request.url.path)
                    body = error_body("internal error", "internal_server_error")
                    return JSONResponse(body, status_code=500)

            return guarded

    router = APIRouter(route_class=OpenAIRoute)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return _frontend(get_frontend).models()

    @router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        frontend = _frontend(get_frontend)
        body = await frontend.tokenize(await _body(frontend, request))
        return Response(body, media_type="application/json")

    @router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, Any]:
        frontend = _frontend(get_frontend)
        return await frontend.detokenize(await _body(frontend, request))

    @router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        frontend = _frontend(get_frontend)
        frontend.check_accepting()
        plan = await frontend.plan_completion(await _body(frontend, request))
        plan = await frontend.compile_grammar(plan)
        await frontend.check_serving()
        return await _generate(frontend, request, plan, arrival)

    @router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        frontend = _frontend(get_frontend)
        frontend.check_accepting()
        plan = await frontend.plan_chat(await _body(frontend, request))
        plan = await frontend.compile_grammar(plan)
        await frontend.check_serving()
        return await _generate(frontend, request, plan, arrival)

    @router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        """The Responses API, served by the chat path: the body is translated to a chat body
        and planned as one (responses_api.py); only the answer's shape differs."""
        arrival = time.monotonic()
        frontend = _frontend(get_frontend)
        frontend.check_accepting()
        plan, req = await frontend.plan_responses(await _body(frontend, request))
        try:
            plan = await frontend.compile_grammar(plan)
        except OpenAIError as exc:
            raise responses_error(exc) from None
        await frontend.check_serving()
        return await _generate(frontend, request, plan, arrival, req)

    return router


async def _body(frontend: Frontend, request: Request) -> bytes:
    return await read_body(request, frontend.settings.max_body_bytes)


def _frontend(get_frontend: FrontendGetter) -> Frontend:
    frontend = get_frontend()
    if frontend is None:
        raise OpenAIError(
            503, "the gateway is starting; retry shortly", type_="service_unavailable"
        )
    return frontend


async def _generate(
    frontend: Frontend,
    request: Request,
    plan: RequestPlan,
    arrival: float,
    responses: ResponsesRequest | None = None,
) -> Response:
    """`responses`: the request came to /v1/responses, and is answered in that API's shape."""
    bind_request_id(plan.request_id)
    handle = await frontend.client.submit(plan)
    settings = frontend.settings
    generation = Generation(
        handle, frontend.tokenizer, settings.request_timeout_s, arrival, settings.progress_timeout_s
    )
    # A Responses body's chat plan is always a stream (responses_api.to_chat_body).
    streamed = plan.stream if responses is None else responses.stream
    if streamed:
        events = (
            generation.stream()
            if responses is None
            else response_events(generation.chunks(), _response_events(generation, responses))
        )
        return StreamingResponse(
            _closing(generation, events), media_type="text/event-stream", headers=SSE_HEADERS
        )
    work = generation.collect() if responses is None else _whole_response(generation, responses)
    try:
        body = await _unless_disconnected(request, work)
    finally:
        generation.close()
    if body is None:
        log.info("client went away; aborted %s", plan.request_id)
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(body)


def _response_events(generation: Generation, req: ResponsesRequest) -> ResponseEvents:
    plan = generation.plan
    return ResponseEvents(
        req, response_id=response_id(plan.request_id), created_at=plan.created, model=plan.model
    )


async def _whole_response(generation: Generation, req: ResponsesRequest) -> dict[str, Any]:
    """A Response that is not streamed: built from the chat stream's chunks, as a streamed one
    is (its chat body is always a stream), so both say the same. A failure is its HTTP error."""
    events = _response_events(generation, req)
    async for chunk in generation.chunks():
        if isinstance(chunk, StreamError):
            raise OpenAIError(chunk.status, chunk.message, type_=chunk.type, code=chunk.code)
        events.feed(chunk)
    return events.whole_response()


async def _closing(generation: Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        generation.close()  # never awaits: safe inside a cancelled stream


async def _unless_disconnected(
    request: Request, work: Awaitable[dict[str, Any]]
) -> dict[str, Any] | None:
    """`work`'s result, or None when the client disconnects first (work is cancelled)."""
    return await result_or_none(work, _disconnected(request))


async def _disconnected(request: Request) -> None:
    # The body is read; what the server sends next on `receive` is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
