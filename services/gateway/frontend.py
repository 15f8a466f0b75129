"""The gateway's working parts, held together for the HTTP routes: settings, tokenizer, model
facts, auth, the planning pool and the bus client. Everything here answers from a raw body to a
plan or a JSON body; the routes only add HTTP (status codes, streaming, disconnects)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.api.auth import ApiKeyAuth
from services.gateway.api.errors import OpenAIError
from services.gateway.plan.grammar_client import GrammarClient
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.planner import Planner
from services.gateway.plan.planning_pool import PlanningPool
from services.gateway.plan.request_plan import RequestPlan
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.bus_client import GatewayBusClient
from shared.config import GatewaySettings


@dataclass
class Frontend:
    settings: GatewaySettings
    tokenizer: PromptTokenizer
    model: ModelInfo
    client: GatewayBusClient
    auth: ApiKeyAuth = field(init=False)
    accepting: bool = True  # False while draining: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: GrammarClient | None = None  # default: the grammar service at grammar_url
    planning: PlanningPool = field(init=False)

    def __post_init__(self) -> None:
        self.auth = ApiKeyAuth(self.settings.api_key_list)
        planner = Planner(self.tokenizer, self.model, self.settings)
        self.planning = PlanningPool(planner, processes=self.settings.planning_processes)
        if self.grammars is None:
            self.grammars = GrammarClient(
                self.settings.grammar_url, self.settings.grammar_timeout_s
            )

    def check_accepting(self) -> None:
        if not self.accepting:
            raise OpenAIError(
                503,
                "the gateway is shutting down; retry on another replica",
                type_="service_unavailable",
            )

    async def plan_completion(self, raw: bytes) -> RequestPlan:
        plan: RequestPlan = await self.planning.run("completion", raw)
        return plan

    async def plan_chat(self, raw: bytes) -> RequestPlan:
        plan: RequestPlan = await self.planning.run("chat", raw)
        return plan

    async def compile_grammar(self, plan: RequestPlan) -> RequestPlan:
        """The plan with its structured-output grammar compiled (GrammarRef.key set), before
        anything is queued. 400 for a spec that does not compile, 503 if the grammar service
        cannot answer; plans without a constraint pass through untouched."""
        if plan.grammar is None or self.grammars is None:
            return plan
        grammar = await self.grammars.compile(plan.grammar, plan.grammar_param)
        return dataclasses.replace(plan, grammar=grammar)

    async def close(self) -> None:
        self.planning.close()
        if self.grammars is not None:
            await self.grammars.close()

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
