"""A gateway wired to a real Redis, and a scheduler's side of the bus driven by the test.

The gateway part is the real thing (Frontend, GatewayBusClient, the mesh view fed by its
heartbeat reader, its grammar client over the bus, the OpenAI router); only the scheduler is
absent: tests read the SubmitRequests it would read and publish the TokenDeltas it would
publish, built from real tokenizer ids, and its heartbeats go out through the real
Heartbeater, saying ready (a group that can serve) unless `scheduler_ready=False`. A test that
needs the grammar service runs the real one (tests/support/grammar_server.py). `serve=True`
also runs the app in a real uvicorn server (for the `openai` client, streaming and
disconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from services.gateway.api.routes import openai_router
from services.gateway.frontend import Frontend
from services.gateway.mesh.groups import MeshView
from services.gateway.mesh.heartbeat_reader import HeartbeatReader, history_for
from services.gateway.plan.grammar_client import GrammarClient
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.route.router import Router
from services.gateway.stream.bus_client import GatewayBusClient
from shared.bus import Bus
from shared.config import GatewaySettings
from shared.heartbeat import Heartbeater
from shared.protocol import AbortRequest, RequestDelta, SubmitRequest, TokenDelta
from shared.rpc import RpcClient
from shared.streams import Streams
from tests.support.stream_counts import entries_added_async

MODEL_NAME = "smollm2"
WAIT_S = 10.0


class SchedulerReadiness:
    """What the test scheduler's heartbeats say; a test flips `ready` to take its group away."""

    def __init__(self, ready: bool) -> None:
        self.ready = ready

    async def is_ready(self) -> bool:
        return self.ready


@dataclass
class GatewayHarness:
    settings: GatewaySettings
    tokenizer: PromptTokenizer
    model: ModelInfo
    frontend: Frontend
    app: FastAPI
    http: httpx.AsyncClient
    scheduler_bus: Bus
    streams: Streams
    mesh_reader: HeartbeatReader
    scheduler: SchedulerReadiness
    base_url: str = ""  # set when served by uvicorn
    _read_ids: dict[str, str] = field(default_factory=dict)

    @property
    def reply_stream(self) -> str:
        return self.frontend.client.reply_stream

    async def next_submit(self) -> SubmitRequest:
        msg = await self._next(self.streams.requests)
        assert isinstance(msg, SubmitRequest)
        return msg

    async def next_abort(self) -> AbortRequest:
        msg = await self._next(self.streams.aborts)
        assert isinstance(msg, AbortRequest)
        return msg

    async def _next(self, stream: str) -> Any:
        """The next entry of `stream` this harness has not read (blocking read, no sleeps)."""
        ids = {stream: self._read_ids.get(stream, "0-0")}
        async with asyncio.timeout(WAIT_S):
            while True:
                got = await self.scheduler_bus.read(ids, count=1, block_ms=200)
                if got:
                    self._read_ids[stream] = ids[stream]
                    return got[0].message

    async def wait_serving(self, ok: bool = True) -> None:
        """Until the gateway's mesh view says its model can (or cannot) be served."""
        model = self.model.name
        async with asyncio.timeout(WAIT_S):
            await self.mesh_reader.wait_for(lambda v: v.serving(model, time.time()).ok == ok)

    async def entries_added(self, stream: str) -> int:
        """Entries ever added to `stream` (tests/support/stream_counts.py)."""
        return await entries_added_async(self.scheduler_bus.redis, stream)

    async def reply(self, *deltas: RequestDelta) -> None:
        """Publish one TokenDelta on the gateway's reply stream, as a scheduler would."""
        msg = TokenDelta(scheduler_id="test-scheduler", deltas=list(deltas))
        await self.scheduler_bus.publish(self.reply_stream, msg)

    async def answer(self, text: str, pieces: int) -> None:
        """Answer the next request with `text`'s token ids in `pieces` deltas, then the
        end-of-turn token (a "stop"), as a scheduler would."""
        submit = await self.next_submit()
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        await self.reply_tokens(submit, ids, size=-(-len(ids) // pieces))

    async def reply_tokens(
        self,
        submit: SubmitRequest,
        ids: list[int],
        finish: str = "stop",
        size: int = 1,
        top: int | None = None,
    ) -> None:
        """Answer `submit` with `ids` in deltas of `size` tokens, as a scheduler would; a
        "stop" ends with the end-of-turn token, which the last delta names. `top`: each token
        with its logprob and `top` alternatives (scripted_logprobs)."""
        eos = self.tokenizer.hf.eos_token_id
        stop = finish == "stop"
        ids = [*ids, eos] if stop else list(ids)
        starts = range(0, len(ids), max(size, 1))
        for start in starts:
            last = start == starts[-1]
            chunk = ids[start : start + size]
            await self.reply(
                RequestDelta(
                    request_id=submit.request_id,
                    start_index=start,
                    token_ids=chunk,
                    finish_reason=finish if last else None,  # type: ignore[arg-type]
                    stop_token_id=eos if last and stop else None,
                    **(scripted_logprobs(start, len(chunk), top) if top is not None else {}),
                )
            )


#: The alternatives scripted_logprobs names: tokens at the end of SmolLM2's vocabulary.
ALTERNATIVE_IDS = range(49100, 49120)


def scripted_logprobs(start: int, n: int, top: int) -> dict[str, list[Any]]:
    """A delta's logprobs for its `n` tokens from output position `start`: position p's token
    has logprob -(p + 1) / 8, and its `top` alternatives are ALTERNATIVE_IDS in order, each
    one lower than the one before, from that."""
    logprobs = [-(p + 1) / 8 for p in range(start, start + n)]
    return {
        "logprobs": logprobs,
        "top_token_ids": [ALTERNATIVE_IDS[j] for _ in logprobs for j in range(top)],
        "top_logprobs": [lp - j for lp in logprobs for j in range(top)],
    }


def load_tokenizer(hf_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_dir(hf_dir)


@contextlib.asynccontextmanager
async def gateway_harness(
    redis_url: str,
    tokenizer: PromptTokenizer,
    hf_dir: Path,
    *,
    serve: bool = False,
    scheduler_ready: bool = True,
    **overrides: Any,
) -> AsyncIterator[GatewayHarness]:
    options: dict[str, Any] = {"instance_id": "gw-test", "served_model_name": MODEL_NAME}
    options.update(overrides)
    settings = GatewaySettings(redis_url=redis_url, model=str(hf_dir), **options)
    model = ModelInfo.from_hf_dir(MODEL_NAME, hf_dir, settings.max_model_len)
    streams = Streams(settings.cluster)
    gateway_bus = Bus(redis_url, consumer=settings.instance_id)
    scheduler_bus = Bus(redis_url, consumer="test-scheduler")
    await gateway_bus.connect()
    await scheduler_bus.connect()
    client = GatewayBusClient(
        gateway_bus, streams, settings.instance_id, max_pending=settings.max_pending_requests
    )
    await client.start()
    interval_s = settings.heartbeat_interval_s
    mesh = MeshView(interval_s)
    reader = HeartbeatReader(
        gateway_bus, streams.heartbeats, mesh, history_s=history_for(interval_s)
    )
    reader.start()
    readiness = SchedulerReadiness(scheduler_ready)
    beats = Heartbeater(
        scheduler_bus,
        streams.heartbeats,
        service="scheduler",
        instance_id="test-scheduler",
        group="0",
        interval_s=interval_s,
        is_ready=readiness.is_ready,
        model=MODEL_NAME,
        role="both",
    )
    stop_beats = asyncio.Event()
    beat_task = asyncio.create_task(beats.run(stop_beats), name="test-scheduler-beats")
    rpc = RpcClient(
        gateway_bus,
        streams.rpc_replies("gateway", settings.instance_id),
        streams.rpc_reply_prefix,
    )
    await rpc.start()
    grammars = GrammarClient(rpc, streams.calls("grammar"), settings.grammar_timeout_s)
    router = Router.from_settings(settings)
    frontend = Frontend(settings, tokenizer, model, client, reader, grammars, router, streams)
    app = FastAPI()
    app.include_router(openai_router(lambda: frontend))
    server: uvicorn.Server | None = None
    server_task: asyncio.Task[None] | None = None
    if serve:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        server_task = asyncio.create_task(server.serve(sockets=[sock]))
        async with asyncio.timeout(WAIT_S):
            while not server.started:  # uvicorn exposes a flag, not an event
                await asyncio.sleep(0.01)
        base_url = f"http://127.0.0.1:{port}"
        http = httpx.AsyncClient(base_url=base_url, timeout=WAIT_S)
    else:
        base_url = ""
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway", timeout=WAIT_S
        )
    harness = GatewayHarness(
        settings, tokenizer, model, frontend, app, http, scheduler_bus, streams, reader,
        readiness, base_url,
    )  # fmt: skip
    try:
        if scheduler_ready:
            await harness.wait_serving()
        yield harness
    finally:
        stop_beats.set()
        await beat_task
        await reader.stop()
        await http.aclose()
        if server is not None and server_task is not None:
            server.should_exit = True
            await server_task
        await client.stop()
        await rpc.stop()
        await frontend.close()
        await gateway_bus.close()
        await scheduler_bus.close()
