"""A raw request body -> its plan or its answer: the gateway's CPU work per request.

Parsing (with the nesting limit), validation, the chat template and tokenization, for the
generation endpoints and for /tokenize and /detokenize. Pure and synchronous: the planning
pool runs it inline for small bodies and in its worker processes for large ones, where each
process holds a Planner of its own. What it returns and raises crosses that process boundary,
so it is plain data (plans, bytes, dicts) or an OpenAIError (which pickles).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from services.gateway.api.errors import OpenAIError, invalid_request
from services.gateway.api.protocol_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from services.gateway.api.responses_api import ResponsesRequest, responses_error, to_chat_body
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.request_plan import (
    RequestPlan,
    check_model_name,
    plan_chat,
    plan_completion,
)
from services.gateway.plan.tokenization import PromptTokenizer
from shared.config import GatewaySettings

M = TypeVar("M", bound=BaseModel)


@dataclass
class Planner:
    tokenizer: PromptTokenizer
    model: ModelInfo
    settings: GatewaySettings

    def completion(self, raw: bytes) -> RequestPlan:
        req = self._parse(CompletionRequest, raw)
        return plan_completion(req, self.tokenizer, self.model, self.settings)

    def chat(self, raw: bytes) -> RequestPlan:
        req = self._parse(ChatCompletionRequest, raw)
        return plan_chat(req, self.tokenizer, self.model, self.settings)

    def responses(self, raw: bytes) -> tuple[RequestPlan, ResponsesRequest]:
        """The Responses API: its body, and the plan of the chat body that serves it
        (responses_api.py); a 400 from the chat path names the field the client sent."""
        req = self._parse(ResponsesRequest, raw)
        chat = json.dumps(to_chat_body(req), ensure_ascii=False).encode()
        try:
            return self.chat(chat), req
        except OpenAIError as exc:
            raise responses_error(exc) from None

    def tokenize(self, raw: bytes) -> bytes:
        """vLLM's /tokenize: a prompt (special tokens added by default) or chat messages (the
        template writes them, so none are added by default). The JSON body comes back
        rendered: a long prompt's id list costs as much to serialise as to make."""
        req = self._parse(TokenizeRequest, raw)
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
                tools=req.tools,
                template_kwargs=req.chat_template_kwargs,
            )
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            assert req.prompt is not None
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add)
        body = {
            "count": len(ids),
            "max_model_len": self.model.max_model_len,
            "tokens": ids,
            "token_strs": self.tokenizer.token_strs(ids) if req.return_token_strs else None,
        }
        return _json_bytes(body)

    def detokenize(self, raw: bytes) -> dict[str, Any]:
        req = self._parse(DetokenizeRequest, raw)
        check_model_name(req.model, self.model)
        for token in req.tokens:
            if token >= self.model.vocab_size:
                raise invalid_request(
                    f"token id {token} is outside the vocabulary [0, {self.model.vocab_size})",
                    "tokens",
                )
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def _parse(self, cls: type[M], raw: bytes) -> M:
        return parse_request(cls, raw, max_depth=self.settings.max_json_depth)


def _json_bytes(body: dict[str, Any]) -> bytes:
    """As Starlette's JSONResponse renders a body."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
