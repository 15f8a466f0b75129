"""vLLM's `bad_words`: the strings a request must never generate, as the token sequences the
worker bans (SamplingParams.bad_words_token_ids; the rule is in the worker's sampler).

A word reads differently at the start of text and after a space (`hello` and `Ġhello` are other
tokens in a byte-level BPE), so each word is tokenized both ways, as vLLM does, and both
sequences are banned. Duplicates are dropped: a word given twice, or one whose two forms
tokenize alike, costs the sampler one entry.
"""

from __future__ import annotations

from services.gateway.api.errors import invalid_request
from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol.requests import MAX_BAD_WORD_TOKENS


def bad_words_token_ids(words: list[str], tok: PromptTokenizer) -> list[list[int]]:
    """The token sequences of `words` (each at the start of text and after a space); a word
    of more than MAX_BAD_WORD_TOKENS tokens is a 400."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for word in words:
        for prefix in ("", " "):
            ids = tok.encode(prefix + word.lstrip(), add_special_tokens=False)
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise invalid_request(
                    f"bad word {word[:40]!r} is {len(ids)} tokens long; at most "
                    f"{MAX_BAD_WORD_TOKENS} are allowed",
                    "bad_words",
                )
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                out.append(ids)
    return out
