"""The gateway service: the OpenAI API on the admin app's port, in front of the mesh.

Start-up order: the HTTP app is served first (so /health answers), then `start()` connects the
bus, starts reading heartbeats into the mesh view, loads the tokenizer and model facts (off the
event loop: the first start may convert the embedded model, ~20 s) and starts the reply
readers (token deltas; the answers to its calls of the grammar service, shared.rpc). Until
then the API answers 503 and /ready says not ready.

Ready means able to serve: besides its own checks, /ready needs at least one alive scheduler with
a ready worker group for the served model (check `workers`, from the mesh view); while there is
none, generation requests get 503 + Retry-After. Draining stops new requests (503) and waits for
those in flight; those still running when the drain's time is up end with a 503 error (body or
SSE event, then [DONE]).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from services.gateway.api.errors import OpenAIError
from services.gateway.api.routes import openai_router
from services.gateway.api_processes import ApiProcess
from services.gateway.frontend import Frontend
from services.gateway.mesh.groups import MeshView
from services.gateway.mesh.heartbeat_reader import HeartbeatReader, history_for
from services.gateway.plan.grammar_client import GrammarClient
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.route.kv_events_reader import HISTORY_S, KVEventsReader
from services.gateway.route.router import Router
from services.gateway.stream.bus_client import GatewayBusClient
from shared.config import GatewaySettings
from shared.model.source import resolve_model
from shared.protocol import SubmitRequest
from shared.rpc import RpcClient
from shared.service import Service

log = logging.getLogger(__name__)


def shutting_down() -> OpenAIError:
    return OpenAIError(
        503,
        "the gateway shut down before the request finished; retry it",
        type_="service_unavailable",
        code="shutting_down",
    )


class GatewayService(Service):
    name = "gateway"

    def __init__(self, settings: GatewaySettings, api_process: ApiProcess | None = None) -> None:
        super().__init__(settings)
        self.settings: GatewaySettings = settings
        self.api_process = api_process  # one of several on the port (MESHLLM_API_PROCESSES)
        self.frontend: Frontend | None = None
        self.mesh = MeshView(settings.heartbeat_interval_s)
        self.mesh_reader: HeartbeatReader | None = None
        self.rpc: RpcClient | None = None
        self.router = Router.from_settings(settings)
        self.kv_reader: KVEventsReader | None = None

    async def start(self) -> None:
        await super().start()
        s = self.settings
        # Recent beats are replayed: a restarted gateway is ready as soon as it has loaded.
        history_s = history_for(self.settings.heartbeat_interval_s)
        reader = HeartbeatReader(self.bus, self.streams.heartbeats, self.mesh, history_s=history_s)
        reader.start()
        self.mesh_reader = reader
        self.kv_reader = KVEventsReader(
            self.bus, self.streams.kv_events, self.router.index, history_s=HISTORY_S
        )
        self.kv_reader.start()
        tokenizer, model = await asyncio.to_thread(self._load_model)
        client = GatewayBusClient(
            self.bus,
            self.streams,
            s.instance_id,
            max_pending=s.max_pending_requests,
            reply_stream_ttl_s=s.reply_stream_ttl_s,
            refresh_interval_s=s.heartbeat_interval_s,
            destination=self._destination,
            released=self._released,
        )
        await client.start()
        self.rpc = RpcClient(
            self.bus,
            self.streams.rpc_replies(self.name, s.instance_id),
            self.streams.rpc_reply_prefix,
        )
        await self.rpc.start()
        grammars = GrammarClient(self.rpc, self.streams.calls("grammar"), s.grammar_timeout_s)
        self.frontend = Frontend(
            s, tokenizer, model, client, reader, grammars, self.router, self.streams
        )
        self.frontend.planning.warm_up()
        if self.api_process is not None:
            self.api_process.mark_started()

    def _destination(self, request: SubmitRequest) -> str:
        assert self.frontend is not None  # requests are submitted only through it
        return self.frontend.destination(request)

    def _released(self, request_id: str) -> None:
        if self.frontend is not None:
            self.frontend.released(request_id)

    def _load_model(self) -> tuple[PromptTokenizer, ModelInfo]:
        s = self.settings
        source = resolve_model(s.model, s.model_cache_dir, s.served_model_name)
        model = ModelInfo.from_hf_dir(source.name, source.hf_dir, s.max_model_len)
        return PromptTokenizer.from_dir(source.hf_dir), model

    async def run(self) -> None:
        await self.stopping.wait()

    def begin_drain(self) -> asyncio.Task[bool]:
        """One API process's drain is all of theirs: they share the port, and a client must
        not keep reaching the ones still taking requests."""
        first = self._drain_task is None
        task = super().begin_drain()
        if first and self.api_process is not None:
            self.api_process.drain_siblings()
        return task

    async def drain(self) -> None:
        if self.frontend is None:
            return
        self.frontend.accepting = False
        try:
            await self.frontend.client.wait_idle()
        except asyncio.CancelledError:
            # The drain's time (shutdown_timeout_s) is up. End what is still in flight with an
            # error its client can read, an SSE error event and [DONE] or a 503 body, before the
            # HTTP server stops and would cut those connections.
            failed = self.frontend.client.fail_in_flight(shutting_down)
            log.warning("drain timed out: %d request(s) in flight ended with a 503", failed)
            raise

    async def close(self) -> None:
        if self.frontend is not None:
            await self.frontend.client.stop()
            await self.frontend.close()
        if self.rpc is not None:
            await self.rpc.stop()
        if self.mesh_reader is not None:
            await self.mesh_reader.stop()
        if self.kv_reader is not None:
            await self.kv_reader.stop()
        await super().close()

    async def check_ready(self) -> tuple[bool, dict[str, Any]]:
        ready, details = await super().check_ready()
        loaded = self.frontend is not None
        details["checks"]["model"] = "ok" if loaded else "loading"
        serving = self.mesh.serving(self.served_model(), time.time())
        details["checks"]["workers"] = serving.reason
        siblings = True
        if self.api_process is not None:  # the port is ready when every process behind it is
            started, count = self.api_process.started_count(), self.api_process.count
            siblings = started == count
            details["checks"]["api_processes"] = "ok" if siblings else f"{started} of {count}"
        return ready and loaded and serving.ok and siblings, details

    def routes(self) -> list[APIRouter]:
        return [openai_router(lambda: self.frontend)]

    def state(self) -> dict[str, Any]:
        out = super().state()
        if self.frontend is not None:
            model = self.frontend.model
            out["gateway"] = {
                "model": model.name,
                "max_model_len": model.max_model_len,
                "moe": model.is_moe,
                "in_flight": self.frontend.client.in_flight,
                "max_pending_requests": self.settings.max_pending_requests,
                "reply_stream": self.frontend.client.reply_stream,
                "accepting": self.frontend.accepting,
                "api_keys": self.frontend.auth.enabled,
            }
        if self.api_process is not None:
            out["api_process"] = self.api_process.describe()
        out["mesh"] = {
            "schedulers": [asdict(r) for r in self.mesh.schedulers(time.time())],
            "beats_read": self.mesh_reader.beats_read if self.mesh_reader else 0,
        }
        out["router"] = {
            "policy": self.settings.router_policy,
            "kv_events_applied": self.router.index.events_applied,
            "groups": {g: self.router.index.num_blocks(g) for g in self.router.index.groups()},
        }
        return out
