"""The gateway's working parts, held together for the HTTP routes: settings, tokenizer, model
facts, auth, the planning pool, the bus client, the mesh view (through its heartbeat reader)
and the grammar service's client. Everything here answers from a raw body to a plan or a JSON
body; the routes only add HTTP (status codes, streaming, disconnects)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.api.auth import ApiKeyAuth
from services.gateway.api.errors import OpenAIError
from services.gateway.api.responses_api import ResponsesRequest
from services.gateway.mesh.groups import MeshView
from services.gateway.mesh.heartbeat_reader import HeartbeatReader
from services.gateway.plan.grammar_client import GrammarClient
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.planner import Planner
from services.gateway.plan.planning_pool import PlanningPool
from services.gateway.plan.request_plan import RequestPlan
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.route.metrics import count_decision, export_groups
from services.gateway.route.router import Candidate, Router
from services.gateway.stream.bus_client import GatewayBusClient
from shared.config import GatewaySettings
from shared.protocol import SubmitRequest
from shared.streams import Streams


@dataclass
class Frontend:
    settings: GatewaySettings
    tokenizer: PromptTokenizer
    model: ModelInfo
    client: GatewayBusClient
    heartbeats: HeartbeatReader
    grammars: GrammarClient
    router: Router
    streams: Streams
    auth: ApiKeyAuth = field(init=False)
    accepting: bool = True  # False while draining: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    planning: PlanningPool = field(init=False)

    def __post_init__(self) -> None:
        self.auth = ApiKeyAuth(self.settings.api_key_list)
        planner = Planner(self.tokenizer, self.model, self.settings)
        self.planning = PlanningPool(planner, processes=self.settings.planning_processes)

    def check_accepting(self) -> None:
        if not self.accepting:
            raise OpenAIError(
                503,
                "the gateway is shutting down; retry on another replica",
                type_="service_unavailable",
            )

    @property
    def mesh(self) -> MeshView:
        return self.heartbeats.view

    async def check_serving(self) -> None:
        """503 + Retry-After while no ready worker group serves this model: a request accepted
        now would wait in the queue for a scheduler that may never come. Called after the body
        is validated, so a client's own mistake is reported first (its 400 precedes this).
        A group that has only just lapsed gets one beat interval to be heard again
        (HeartbeatReader.serving) before the request is refused."""
        serving = await self.heartbeats.serving(self.model.name)
        if not serving.ok:
            # About one beat interval: a group that becomes ready is known after its next beat.
            retry_after = max(1, math.ceil(self.settings.heartbeat_interval_s))
            raise OpenAIError(
                503,
                f"{serving.reason}; retry in {retry_after} s",
                type_="service_unavailable",
                headers={"Retry-After": str(retry_after)},
            )

    def destination(self, request: SubmitRequest) -> str:
        """The stream a request goes to: the routed group's own, or the shared requests stream
        when no group is routable (prefill/decode groups, schedulers without load reports).
        429 + Retry-After when every group's queue is full (the router's bounds)."""
        now = time.time()
        routable = self.mesh.routable(self.model.name, now)
        self.router.forget(self.mesh.groups())
        candidates = [Candidate(r.group, r.load, r.last_beat) for r in routable if r.load]
        export_groups(candidates, self.router)
        if not candidates:
            return self.streams.requests
        decision = self.router.choose(
            candidates,
            list(request.prompt_token_ids),
            request.cache_salt,
            now,
            request_id=request.request_id,
        )
        count_decision(decision)
        if decision.group is None:
            # A queue moves on at least once per beat; the next beat says by how much.
            retry_after = max(1, math.ceil(self.settings.heartbeat_interval_s))
            raise OpenAIError(
                429,
                f"the mesh is at capacity ({decision.reason}); retry in {retry_after} s",
                type_="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry_after)},
            )
        return self.streams.group_requests(decision.group)

    def released(self, request_id: str) -> None:
        """A request ended on this gateway (last reply, abort, failure): its group's load no
        longer counts it."""
        self.router.finished(request_id, time.time())

    async def plan_completion(self, raw: bytes) -> RequestPlan:
        plan: RequestPlan = await self.planning.run("completion", raw)
        return plan

    async def plan_chat(self, raw: bytes) -> RequestPlan:
        plan: RequestPlan = await self.planning.run("chat", raw)
        return plan

    async def plan_responses(self, raw: bytes) -> tuple[RequestPlan, ResponsesRequest]:
        planned: tuple[RequestPlan, ResponsesRequest] = await self.planning.run("responses", raw)
        return planned

    async def compile_grammar(self, plan: RequestPlan) -> RequestPlan:
        """The plan with its structured-output grammar compiled (GrammarRef.key set), before
        anything is queued. 400 for a spec that does not compile, 503 if the grammar service
        cannot answer; plans without a constraint pass through untouched."""
        if plan.grammar is None:
            return plan
        grammar = await self.grammars.compile(plan.grammar, plan.grammar_param)
        return dataclasses.replace(plan, grammar=grammar)

    async def close(self) -> None:
        await asyncio.to_thread(self.planning.close, wait=True)

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "meshllm",
            "root": self.model.name,
            "max_model_len": self.model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def tokenize(self, raw: bytes) -> bytes:
        """/tokenize's JSON body."""
        rendered: bytes = await self.planning.run("tokenize", raw)
        return rendered

    async def detokenize(self, raw: bytes) -> dict[str, Any]:
        answer: dict[str, Any] = await self.planning.run("detokenize", raw)
        return answer
