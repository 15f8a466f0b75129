"""vLLM's bad_words as token sequences, with the SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from services.gateway.api.errors import OpenAIError
from services.gateway.plan.bad_words import bad_words_token_ids
from services.gateway.plan.tokenization import PromptTokenizer
from shared.protocol.requests import MAX_BAD_WORD_TOKENS


def test_each_word_at_the_start_and_after_a_space(tokenizer: PromptTokenizer) -> None:
    got = bad_words_token_ids(["Paris", "  New York"], tokenizer)

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert got == [enc("Paris"), enc(" Paris"), enc("New York"), enc(" New York")]
    assert enc("Paris") != enc(" Paris")  # two sequences, or the test proves nothing
    assert tokenizer.decode(got[3]) == " New York"


def test_repeats_are_banned_once(tokenizer: PromptTokenizer) -> None:
    assert bad_words_token_ids(["cat", " cat", "cat"], tokenizer) == bad_words_token_ids(
        ["cat"], tokenizer
    )


def test_a_word_past_the_token_limit_is_a_400(tokenizer: PromptTokenizer) -> None:
    long_word = " x" * (MAX_BAD_WORD_TOKENS + 1)
    assert len(tokenizer.encode(long_word, add_special_tokens=False)) > MAX_BAD_WORD_TOKENS
    with pytest.raises(OpenAIError) as err:
        bad_words_token_ids(["fine", long_word], tokenizer)
    assert err.value.status == 400 and err.value.param == "bad_words"
