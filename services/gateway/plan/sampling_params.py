"""An OpenAI request's sampling fields -> the protocol's SamplingParams.

Omitted fields take OpenAI's defaults (temperature 1, top_p 1, no penalties). vLLM's top_k
accepts -1 and 0 for "disabled"; the protocol uses 0. The seed is left at 0 here: the bus client
fills the real one (the client's, or one it draws), so every request carries one.
"""

from __future__ import annotations

from services.gateway.api.protocol_openai import SamplingFields
from shared.protocol import SamplingParams


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    bad_words_token_ids: list[list[int]] | None = None,
) -> SamplingParams:
    """`max_tokens` is the checked value (see validation.check_prompt); `logprobs` the number of
    top alternatives per token when logprobs were asked for (0 = the chosen token only), and
    `prompt_logprobs` the same for the prompt's tokens (the request's `prompt_logprobs`, or
    completions' echo with logprobs); `bad_words_token_ids` the tokenized `bad_words`."""
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        seed=0,  # placeholder: GatewayBusClient.submit sets the real one per choice
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=dict(req.logit_bias or {}),
        allowed_token_ids=req.allowed_token_ids,
        bad_words_token_ids=bad_words_token_ids or [],
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
