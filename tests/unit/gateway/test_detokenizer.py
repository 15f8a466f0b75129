"""Incremental detokenization never emits half a character and adds up to the full decode."""

from __future__ import annotations

import pytest

from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "Crème brûlée à la française, naïve café.",
    "日本語のテキストと中文字符",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 in a row",
    "Mixed: Здравствуйте, мир — ελληνικά — עברית 🚀",
]


def stream(tok: PromptTokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up(tokenizer: PromptTokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    pieces = stream(tokenizer, prompt, ids)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_emoji_split_over_tokens_is_held_back_until_complete(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # SmolLM2 spells this emoji in several byte tokens
    # Decoding the partial tokens on their own shows why holding back is needed.
    assert "\ufffd" in tokenizer.decode(ids[:1])
    detok = IncrementalDetokenizer(tokenizer, [])
    held = [detok.push(t) for t in ids[:-1]]
    assert held == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "😀"


def test_output_cut_mid_character_flushes_a_replacement(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    pieces = stream(tokenizer, [], ids[:-1])
    assert "".join(pieces) == tokenizer.decode(ids[:-1])  # as a full decode renders it
    assert pieces[-1].endswith("\ufffd")


def test_special_tokens_render_as_nothing(tokenizer: PromptTokenizer) -> None:
    eos = tokenizer.hf.eos_token_id
    ids = [*tokenizer.encode("Done.", add_special_tokens=False), eos]
    assert "".join(stream(tokenizer, [], ids)) == "Done."


def test_leading_space_of_first_token_kept_with_prompt_context(tokenizer: PromptTokenizer) -> None:
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    ids = tokenizer.encode("The answer is forty-two", add_special_tokens=False)[len(prompt) :]
    assert "".join(stream(tokenizer, prompt, ids)) == " forty-two"
