"""Logprobs as the API returns them: legacy completions logprobs (echoed prompt included),
chat logprobs, and vLLM's `prompt_logprobs`.

Tokens are named by their text (`PromptTokenizer.token_text`: the token's bytes as UTF-8), or
as `token_id:<id>` when the request asks for vLLM's `return_tokens_as_token_ids` (a client that
must map logprobs back to ids exactly, whatever the token's bytes).

Logprobs are finite in JSON: -inf (a token the sampler could never pick) becomes -9999.0, as
vLLM renders it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.choice_assembler import TokenLogprob

MIN_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


@dataclass(frozen=True)
class TokenNames:
    tok: PromptTokenizer
    as_ids: bool = False

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.tok.token_text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        """Chat's `bytes`: the token's own bytes (of its name, when named by id)."""
        raw = self.text(token_id).encode() if self.as_ids else self.tok.token_bytes(token_id)
        return list(raw)


def completion_logprobs(
    names: TokenNames, entries: list[TokenLogprob], text_offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs; `text_offset` is where the first token's text starts in the
    choice's text. Returns the object and the offset after the last token."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = names.text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(finite(entry.logprob))
        tops.append({names.text(t): finite(lp) for t, lp in entry.top})
        offsets.append(text_offset)
        text_offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, text_offset


def echo_logprobs(
    names: TokenNames, prompt_ids: list[int], entries: list[TokenLogprob], k: int
) -> dict[str, Any]:
    """The echoed prompt's part of legacy completions logprobs: every prompt token, the first
    with a null logprob and null alternatives (nothing comes before it), as vLLM returns it;
    `k` alternatives each (the entries may hold more, for the request's prompt_logprobs)."""
    texts = [names.text(t) for t in prompt_ids]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": [None] + [finite(e.logprob) for e in entries],
        "top_logprobs": [None]
        + [{names.text(t): finite(lp) for t, lp in e.top[:k]} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(names: TokenNames, entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": names.text(token_id),
            "logprob": finite(logprob),
            "bytes": names.bytes(token_id),
        }

    content = [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def prompt_logprobs(
    names: TokenNames, entries: list[TokenLogprob], k: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token an object
    keyed by token id holding the prompt token and its `k` most likely alternatives, each
    with its logprob, rank and decoded text."""

    def logprob(token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": finite(value), "rank": rank, "decoded_token": names.text(token_id)}

    out: list[dict[str, Any] | None] = [None]
    for entry in entries:
        item = {str(entry.token_id): logprob(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, value) in enumerate(entry.top[:k], start=1):
            item[str(token_id)] = logprob(token_id, value, rank)
        out.append(item)
    return out
