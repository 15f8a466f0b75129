"""An API request, validated and tokenized: what will be submitted and how to answer it.

`plan_completion` / `plan_chat` run every check (pydantic already ran the per-field ones),
tokenize the prompt(s) and settle the per-prompt sampling parameters. The plan is pure data; the
bus client turns it into SubmitRequests, the choice assemblers and response builders read it.

Choices: a completions request with P prompts and n choices has P*n choices, indexed
`prompt * n + i` (vLLM's order). Choice k is one scheduler request `<request_id>-<k>` sampled
with seed `seed + i`: the same prompt and seed give the same choice i whatever else is batched
with it, and the n choices of one prompt differ.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from services.gateway.api.errors import OpenAIError
from services.gateway.api.protocol_openai import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.gateway.plan.bad_words import bad_words_token_ids
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.sampling_params import sampling_params
from services.gateway.plan.structured_outputs import grammar_param, grammar_ref
from services.gateway.plan.tokenization import PromptTokenizer, PromptTooLong, TokenizedPrompt
from services.gateway.plan.tool_choice import ToolCalling, plan_tools
from services.gateway.plan.validation import (
    check_prompt,
    check_request,
    check_routed_experts_start,
    prompt_too_long,
)
from services.gateway.stream.reasoning import ReasoningParserName
from shared.config import GatewaySettings
from shared.protocol import GrammarRef, SamplingParams, SubmitRequest


@dataclass(frozen=True)
class RequestPlan:
    kind: Literal["completion", "chat"]
    request_id: str  # cmpl-... / chatcmpl-...; choice k runs as `<request_id>-<k>`
    created: int
    model: str
    prompts: list[TokenizedPrompt]
    samplings: list[SamplingParams]  # one per prompt (max_tokens may differ); seed not set
    n: int
    seed: int | None  # the client's; None = the bus client draws one
    stop: list[str]
    grammar: GrammarRef | None
    return_routed_experts: bool
    routed_experts_prompt_start: int
    echo: bool
    logprobs: int | None  # top alternatives per token; None = no logprobs
    stream: bool
    include_usage: bool
    continuous_usage: bool  # with include_usage: usage on every chunk, not only the last
    user: str | None
    grammar_param: str | None = None  # the request field `grammar` came from (for a 400)
    tools: ToolCalling | None = None  # chat: how the output is read as tool calls
    reasoning: ReasoningParserName = ""  # chat: the parser that splits off the reasoning
    # vLLM's: the request's `prompt_logprobs` (returned as such; echo's are in `logprobs`).
    prompt_logprobs: int | None = None
    include_stop: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name `token_id:<id>`
    cache_salt: str | None = None
    priority: int = 0

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> TokenizedPrompt:
        return self.prompts[choice // self.n]

    def choice_request_id(self, choice: int) -> str:
        return f"{self.request_id}-{choice}"

    @property
    def num_prompt_tokens(self) -> int:
        """Usage counts each prompt once, however many choices it has (as OpenAI does)."""
        return sum(len(p.token_ids) for p in self.prompts)

    def submit_requests(
        self, seed: int, reply_stream: str, arrival_time: float
    ) -> list[SubmitRequest]:
        out = []
        for choice in range(self.num_choices):
            prompt_index, i = divmod(choice, self.n)
            sampling = self.samplings[prompt_index].model_copy(update={"seed": seed + i})
            out.append(
                SubmitRequest(
                    request_id=self.choice_request_id(choice),
                    prompt_token_ids=self.prompts[prompt_index].token_ids,
                    sampling=sampling,
                    reply_stream=reply_stream,
                    arrival_time=arrival_time,
                    grammar=self.grammar,
                    return_routed_experts=self.return_routed_experts,
                    routed_experts_prompt_start=self.routed_experts_prompt_start,
                    cache_salt=self.cache_salt,
                    priority=self.priority,
                )
            )
        return out


def check_model_name(requested: str | None, model: ModelInfo) -> None:
    if requested is not None and requested != model.name:
        raise OpenAIError(
            404,
            f"The model `{requested}` does not exist. This server serves `{model.name}`.",
            param="model",
            code="model_not_found",
        )


def plan_completion(
    req: CompletionRequest, tok: PromptTokenizer, model: ModelInfo, settings: GatewaySettings
) -> RequestPlan:
    check_model_name(req.model, model)
    check_request(req, settings, model)
    keep = req.truncate_prompt_tokens
    try:
        prompts = [
            truncated(
                tok.completion_prompt(p, token_limit=_limit(keep, model), echo=req.echo),
                keep,
                tok,
                echo=req.echo,
            )
            for p in req.prompt
        ]
    except PromptTooLong as exc:
        raise prompt_too_long(exc.num_tokens, model, "prompt") from None
    words = bad_words_token_ids(req.bad_words, tok) if req.bad_words else []
    # echo with logprobs (lm-eval's loglikelihood requests) wants the prompt's logprobs too:
    # one computation serves both, with the larger number of alternatives.
    asked = [req.prompt_logprobs, req.logprobs if req.echo else None]
    prompt_logprobs = max((k for k in asked if k is not None), default=None)
    samplings = []
    for prompt in prompts:
        max_tokens = check_prompt(
            prompt.token_ids,
            req.max_tokens,
            model,
            prompt_param="prompt",
            max_tokens_param="max_tokens",
            min_tokens=req.min_tokens,
            default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
        )
        samplings.append(
            sampling_params(
                req,
                max_tokens=max_tokens,
                logprobs=req.logprobs,
                prompt_logprobs=prompt_logprobs,
                bad_words_token_ids=words,
            )
        )
    return _plan(
        "completion",
        f"cmpl-{uuid.uuid4().hex}",
        req,
        prompts,
        samplings,
        model,
        max_json_depth=settings.max_json_depth,
        echo=req.echo,
        logprobs=req.logprobs,
    )


def plan_chat(
    req: ChatCompletionRequest, tok: PromptTokenizer, model: ModelInfo, settings: GatewaySettings
) -> RequestPlan:
    check_model_name(req.model, model)
    check_request(req, settings, model)
    tools, tool_grammar = plan_tools(req, settings.tool_call_parser)
    keep = req.truncate_prompt_tokens
    try:
        prompt = tok.chat_prompt(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            token_limit=_limit(keep, model),
            tools=req.tools,
            template_kwargs=req.template_variables,
        )
        prompt = truncated(prompt, keep, tok)
    except PromptTooLong as exc:
        raise prompt_too_long(exc.num_tokens, model, "messages") from None
    max_tokens = check_prompt(
        prompt.token_ids,
        req.max_new_tokens,
        model,
        prompt_param="messages",
        max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        min_tokens=req.min_tokens,
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    words = bad_words_token_ids(req.bad_words, tok) if req.bad_words else []
    sampling = sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        bad_words_token_ids=words,
    )
    plan = _plan(
        "chat",
        f"chatcmpl-{uuid.uuid4().hex}",
        req,
        [prompt],
        [sampling],
        model,
        max_json_depth=settings.max_json_depth,
        echo=False,
        logprobs=logprobs,
    )
    plan = dataclasses.replace(plan, tools=tools, reasoning=settings.reasoning_parser)
    if tool_grammar is None:
        return plan
    # plan_tools refused response_format / structured_outputs beside a forcing tool choice.
    return dataclasses.replace(plan, grammar=tool_grammar, grammar_param="tools")


def _plan(
    kind: Literal["completion", "chat"],
    request_id: str,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[TokenizedPrompt],
    samplings: list[SamplingParams],
    model: ModelInfo,
    *,
    max_json_depth: int,
    echo: bool,
    logprobs: int | None,
) -> RequestPlan:
    start = req.routed_experts_prompt_start or 0
    if req.return_routed_experts:
        for prompt in prompts:
            check_routed_experts_start(start, len(prompt.token_ids))
    return RequestPlan(
        kind=kind,
        request_id=request_id,
        created=int(time.time()),
        model=model.name,
        prompts=prompts,
        samplings=samplings,
        n=req.n,
        seed=req.seed,
        stop=list(req.stop or []),
        grammar=grammar_ref(req.response_format, req.structured_outputs, max_depth=max_json_depth),
        return_routed_experts=req.return_routed_experts,
        routed_experts_prompt_start=start,
        echo=echo,
        logprobs=logprobs,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(
            req.stream_options
            and req.stream_options.include_usage
            and req.stream_options.continuous_usage_stats
        ),
        user=req.user,
        grammar_param=grammar_param(req.response_format, req.structured_outputs),
        prompt_logprobs=req.prompt_logprobs,
        include_stop=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        tokens_as_ids=req.return_tokens_as_token_ids,
        cache_salt=req.cache_salt,
        priority=req.priority,
    )


def _limit(keep: int | None, model: ModelInfo) -> int | None:
    """The token limit of tokenization: the context, unless the prompt is to be truncated (then
    its length does not matter; the body's size bounds it)."""
    return model.max_model_len if keep is None else None


def truncated(
    prompt: TokenizedPrompt, keep: int | None, tok: PromptTokenizer, *, echo: bool = True
) -> TokenizedPrompt:
    """vLLM's truncate_prompt_tokens: only the prompt's last `keep` tokens (its text, for echo,
    then the decoded ids; empty without echo)."""
    if keep is None or len(prompt.token_ids) <= keep:
        return prompt
    ids = prompt.token_ids[-keep:]
    return TokenizedPrompt(ids, tok.decode(ids, skip_special_tokens=False) if echo else "")
