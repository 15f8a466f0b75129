"""Speculative decoding of requests whose sampling reads what they output (penalties,
min_tokens) on a tiny random Llama: each verify position must draw with the drafts before it
counted as outputs, so the tokens equal plain decoding's, greedy and seeded.

The drafts come from an oracle, the plain run's own tokens: every draft is one plain decoding
wrote, so verification accepts them wherever each position is sampled as plain decoding
sampled it. A position that missed the drafts before it (penalties as if they had not been
output, a stop still held back by min_tokens) picks otherwise, and the outputs differ: with a
strong penalty on a small random model, the token a penalty pushed aside is often the next
best."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.worker.spec import SpeculativeConfig
from services.worker.spec.ngram import NgramProposer
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import make_tiny_llama

NGRAM = SpeculativeConfig(method="ngram", num_spec_tokens=4)
PROMPTS = {
    "loop": [5, 9, 3, 7, 5, 9, 3, 7, 5, 9],
    "pairs": [11, 12, 11, 12, 11],
    "count": list(range(3, 30)),
}
BASE = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
CASES = {
    "presence": BASE.model_copy(update={"presence_penalty": 2.0}),
    "frequency": BASE.model_copy(update={"frequency_penalty": 1.0}),
    "repetition": BASE.model_copy(update={"repetition_penalty": 3.0}),
    "presence-seeded": BASE.model_copy(
        update={"temperature": 0.9, "seed": 7, "presence_penalty": 3.0, "logprobs": 1}
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-spec-history")
    make_tiny_llama(path, vocab_size=64)
    return path


def oracle(monkeypatch: pytest.MonkeyPatch, sequences: list[list[int]]) -> None:
    """Prompt lookup replaced by the continuation of whichever sequence the row's tokens
    begin: the plain run's next tokens, none once the row left every sequence."""

    def propose(
        self: NgramProposer, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
        ks: np.ndarray,
    ) -> list[list[int]]:  # fmt: skip
        drafts = []
        for row, length, k in zip(rows.tolist(), lengths.tolist(), ks.tolist(), strict=True):
            have = token_ids[row, :length].tolist()
            ahead = [s[length : length + k] for s in sequences if s[:length] == have]
            drafts.append(ahead[0] if ahead and k else [])
        return drafts

    monkeypatch.setattr(NgramProposer, "propose", propose)


def run(tiny: Path, params: SamplingParams, spec: SpeculativeConfig | None, device: str = "cpu"):
    engine = InProcessEngine(tiny, block_size=4, speculative=spec, device=device)
    return engine, {rid: gen for rid, gen in engine.generate(PROMPTS, params).items()}


def check_equal_with_oracle_drafts(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, params: SamplingParams, device: str = "cpu"
) -> None:
    _, plain = run(tiny, params, None, device)
    oracle(monkeypatch, [PROMPTS[rid] + gen.token_ids for rid, gen in plain.items()])
    engine, spec = run(tiny, params, NGRAM, device)
    assert {r: g.token_ids for r, g in spec.items()} == {r: g.token_ids for r, g in plain.items()}
    stats = engine.scheduler.spec.stats
    # every draft stood: each position drew as plain decoding did
    assert stats.num_accepted_tokens == stats.num_draft_tokens > len(PROMPTS) * 8
    if params.logprobs is not None:
        for rid, gen in spec.items():
            assert gen.logprobs == pytest.approx(plain[rid].logprobs, abs=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_penalized_requests_speculate_and_equal_plain_decoding(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    check_equal_with_oracle_drafts(tiny, monkeypatch, CASES[case])


def test_min_tokens_counts_the_drafts_before_each_position(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_min_tokens(tiny, monkeypatch)


def check_min_tokens(tiny: Path, monkeypatch: pytest.MonkeyPatch, device: str = "cpu") -> None:
    """With min_tokens m, a stop token is held back at outputs below m and allowed from m on,
    within one verify step. The stop is a token the free run first writes at output s, inside
    a step (after the first output each step verifies 4 drafts and adds one: outputs 1-5, 6-10,
    ...), with m = s - 1: plain decoding stops at s, where a position that did not count the
    drafts before it would still hold the stop back."""
    _, free = run(tiny, BASE, None, device)
    output = free["loop"].token_ids
    s = next(i for i in range(7, 20) if i % 5 != 1 and output[i] not in output[:i])
    params = BASE.model_copy(
        update={"ignore_eos": False, "stop_token_ids": [output[s]], "min_tokens": s - 1}
    )
    _, plain = run(tiny, params, None, device)
    assert plain["loop"].token_ids == output[: s + 1]
    check_equal_with_oracle_drafts(tiny, monkeypatch, params, device)
