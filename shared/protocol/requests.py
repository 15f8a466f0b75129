"""Gateway -> scheduler messages: a validated, tokenized request, and its abort."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shared.protocol.base import Message, Struct, register
from shared.protocol.packed import INT32_MAX, INT32_MIN, PackedInt32

MAX_STREAM_NAME = 512
#: Bounds on vLLM's `bad_words` (a word is matched against the latest outputs every step).
MAX_BAD_WORDS = 256
MAX_BAD_WORD_TOKENS = 64


class SamplingParams(Struct):
    """Everything the worker needs to turn logits into the next token.

    The gateway fills `seed` when the client gave none, so every sample can be reproduced and a
    request restarted after a crash regenerates the same tokens.
    """

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=INT32_MAX)  # 0 = disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int = Field(0, ge=0, lt=2**64)
    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: PackedInt32 = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    allowed_token_ids: PackedInt32 | None = None
    bad_token_ids: PackedInt32 = Field(default_factory=list)
    # vLLM's `bad_words`, each word as token ids: the word's last token is banned after its
    # other tokens were the request's latest outputs (a one-token word: always banned).
    bad_words_token_ids: list[PackedInt32] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)  # top-k per token (0 = chosen only)
    # The same for every prompt token after the first (its logprob given the tokens before
    # it); None = not computed. Such a request takes no prefix-cache hit.
    prompt_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)

    @field_validator("bad_words_token_ids")
    @classmethod
    def _words_not_empty(cls, value: list[list[int]]) -> list[list[int]]:
        for word in value:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"a bad word must have 1 to {MAX_BAD_WORD_TOKENS} token ids")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_fit_int32(cls, value: dict[int, float]) -> dict[int, float]:
        for token in value:
            if not INT32_MIN <= token <= INT32_MAX:
                raise ValueError(f"logit_bias token id {token} does not fit int32")
        return value


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"]


class GrammarRef(Struct):
    """A structured-output constraint. `key` names the compiled grammar in the grammar cache."""

    kind: GrammarKind
    spec: str
    key: str = ""


@register
class SubmitRequest(Message):
    TYPE = "submit"
    VERSION = 1

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: PackedInt32 = Field(min_length=1)
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams())
    reply_stream: str = Field(min_length=1, max_length=MAX_STREAM_NAME)
    arrival_time: float = 0.0
    grammar: GrammarRef | None = None
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = Field(0, ge=0)
    cache_salt: str | None = None
    # vLLM's: lower is served earlier under the scheduler's `priority` policy; with `fcfs`
    # (the default) any other value than 0 is refused.
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX)


@register
class AbortRequest(Message):
    TYPE = "abort"
    VERSION = 1

    request_id: str = Field(min_length=1, max_length=256)
    reason: str = "client"
