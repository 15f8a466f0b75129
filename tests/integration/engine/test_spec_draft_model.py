"""Draft-model speculative decoding on tiny random Llamas (the draft shares the vocabulary):
greedy output, batched, equals transformers' greedy output of the target, token for token.
A draft identical to the target must have nearly every draft accepted, which checks that the
draft's private KV cache follows the verified tokens (catch-up after accepts and rejections)."""

from __future__ import annotations

import pytest
import torch

from services.worker.loader import load_model
from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import make_tiny_llama, reference_greedy

PROMPTS = {"a": [5, 17, 99, 3, 250, 41], "b": [7, 7, 300, 12], "c": list(range(20, 45))}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("target")
    target = make_tiny_llama(target_dir, seed=0)
    other_dir = tmp_path_factory.mktemp("draft")
    make_tiny_llama(other_dir, seed=1, num_hidden_layers=1)
    reference = {rid: reference_greedy(target, p, NEW_TOKENS) for rid, p in PROMPTS.items()}
    return target_dir, other_dir, reference


def run(target_dir, draft_dir) -> tuple[dict[str, list[int]], InProcessEngine]:
    spec = SpeculativeConfig(method="draft", model=str(draft_dir), num_spec_tokens=3)
    engine = InProcessEngine(
        target_dir, model_and_config=load_model(target_dir, torch.float32), speculative=spec
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = engine.generate(PROMPTS, params)
    return {rid: gen.token_ids for rid, gen in out.items()}, engine


def test_a_draft_equal_to_the_target_is_accepted_and_exact(models) -> None:
    target_dir, _, reference = models
    out, engine = run(target_dir, target_dir)
    assert out == reference
    stats = engine.scheduler.spec.stats
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate > 0.9


def test_a_different_draft_changes_nothing_in_the_output(models) -> None:
    target_dir, other_dir, reference = models
    out, engine = run(target_dir, other_dir)
    assert out == reference
    assert engine.scheduler.spec.stats.num_draft_tokens > 0
