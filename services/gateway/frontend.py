"""The gateway's working parts, held together for the HTTP routes: settings, tokenizer, model
facts, auth, the bus client, the mesh view and the grammar service's client. Everything here
answers from a raw body to a plan or a JSON body; the routes only add HTTP (status codes,
streaming, disconnects)."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.api.auth import ApiKeyAuth
from services.gateway.api.errors import OpenAIError, invalid_request
from services.gateway.api.protocol_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from services.gateway.mesh.groups import MeshView
from services.gateway.plan.grammar_client import GrammarClient
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.request_plan import (
    RequestPlan,
    check_model_name,
    plan_chat,
    plan_completion,
)
from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.bus_client import GatewayBusClient
from shared.config import GatewaySettings


@dataclass
class Frontend:
    settings: GatewaySettings
    tokenizer: PromptTokenizer
    model: ModelInfo
    client: GatewayBusClient
    mesh: MeshView
    grammars: GrammarClient
    auth: ApiKeyAuth = field(init=False)
    accepting: bool = True  # False while draining: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.auth = ApiKeyAuth(self.settings.api_key_list)

    def check_accepting(self) -> None:
        if not self.accepting:
            raise OpenAIError(
                503,
                "the gateway is shutting down; retry on another replica",
                type_="service_unavailable",
            )

    def check_serving(self) -> None:
        """503 + Retry-After while no ready worker group serves this model: a request accepted
        now would wait in the queue for a scheduler that may never come. Called after the body
        is validated, so a client's own mistake is reported first (its 400 precedes this)."""
        serving = self.mesh.serving(self.model.name, time.time())
        if not serving.ok:
            # About one beat interval: a group that becomes ready is known after its next beat.
            retry_after = max(1, math.ceil(self.settings.heartbeat_interval_s))
            raise OpenAIError(
                503,
                f"{serving.reason}; retry in {retry_after} s",
                type_="service_unavailable",
                headers={"Retry-After": str(retry_after)},
            )

    def plan_completion(self, raw: bytes) -> RequestPlan:
        req = parse_request(CompletionRequest, raw)
        return plan_completion(req, self.tokenizer, self.model, self.settings)

    def plan_chat(self, raw: bytes) -> RequestPlan:
        req = parse_request(ChatCompletionRequest, raw)
        return plan_chat(req, self.tokenizer, self.model, self.settings)

    async def compile_grammar(self, plan: RequestPlan) -> RequestPlan:
        """The plan with its structured-output grammar compiled (GrammarRef.key set), before
        anything is queued. 400 for a spec that does not compile, 503 if the grammar service
        cannot answer; plans without a constraint pass through untouched."""
        if plan.grammar is None:
            return plan
        grammar = await self.grammars.compile(plan.grammar, plan.grammar_param)
        return dataclasses.replace(plan, grammar=grammar)

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

    def tokenize(self, raw: bytes) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt (special tokens added by default) or chat messages (the
        template writes them, so none are added by default)."""
        req = parse_request(TokenizeRequest, raw)
        check_model_name(req.model, self.model)
        if req.messages is not None:
            if req.continue_final_message and req.add_generation_prompt:
                raise invalid_request(
                    "continue_final_message needs add_generation_prompt to be false",
                    "continue_final_message",
                )
            text = self.tokenizer.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
            )
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            assert req.prompt is not None
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add)
        return {
            "count": len(ids),
            "max_model_len": self.model.max_model_len,
            "tokens": ids,
            "token_strs": self.tokenizer.token_strs(ids) if req.return_token_strs else None,
        }

    def detokenize(self, raw: bytes) -> dict[str, Any]:
        req = parse_request(DetokenizeRequest, raw)
        check_model_name(req.model, self.model)
        for token in req.tokens:
            if token >= self.model.vocab_size:
                raise invalid_request(
                    f"token id {token} is outside the vocabulary [0, {self.model.vocab_size})",
                    "tokens",
                )
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}
