"""n-gram speculative decoding under tensor parallelism (two real gloo ranks, SmolLM2: its 3 KV
heads split 1 + 2): both ranks propose the same drafts and accept the same tokens, and the
greedy output equals the same group's without speculation and transformers', with drafts
really verified (some accepted, so fewer steps; some rejected)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_llama import reference_greedy
from tests.support.tp_families import ngram_greedy
from tests.support.tp_ranks import run_ranks

MAX_TOKENS = 16
CHATS = {
    "copy": "Repeat this sentence exactly: the cat sat on the warm mat next to the door.",
    "code": "Fix the typo and print the code again:\ndef add(a, b):\n    retrun a + b\n",
}


@pytest.fixture(scope="module")
def runs(smollm2_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = {}
    for rid, text in CHATS.items():
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompts[rid] = tokenizer(chat, add_special_tokens=False)["input_ids"]
    torch.set_num_threads(1)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    expected = {rid: reference_greedy(reference, p, MAX_TOKENS) for rid, p in prompts.items()}
    return {
        "expected": expected,
        "tp2": run_ranks(ngram_greedy, 2, str(smollm2_dir), prompts, MAX_TOKENS),
    }


def test_tp2_ngram_greedy_equals_no_speculation_and_transformers(runs: dict[str, Any]) -> None:
    rank0, rank1 = runs["tp2"]
    assert rank0["plain"]["outputs"] == runs["expected"]
    assert rank0["ngram"]["outputs"] == runs["expected"]
    assert rank1["ngram"]["outputs"] == rank0["ngram"]["outputs"]


def test_tp2_drafts_were_verified_alike_on_both_ranks(runs: dict[str, Any]) -> None:
    rank0, rank1 = (r["ngram"] for r in runs["tp2"])
    assert (rank0["drafted"], rank0["accepted"]) == (rank1["drafted"], rank1["accepted"])
    assert 0 < rank0["accepted"] < rank0["drafted"]
    assert rank0["steps"] < runs["tp2"][0]["plain"]["steps"]  # accepted drafts save steps
