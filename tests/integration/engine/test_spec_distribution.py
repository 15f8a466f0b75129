"""Seeded sampling with n-gram speculation samples the target's distribution: chi-square of
many draws on a tiny random model against the exact distribution from transformers.

Tokens 2 and 3 of each output come out of verification steps (prompt lookup with n = 1 always
finds a draft: the prompt holds every token), so both acceptance and the residual draw after a
rejection shape them. The test checks the joint distribution of (token 2, token 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.loader import load_model
from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import make_tiny_llama

VOCAB = 16
DRAWS = 600
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec")
    # A small init spread keeps the distribution wide: many distinct draws, many rejections.
    hf = make_tiny_llama(
        path, seed=3, vocab_size=VOCAB, initializer_range=0.08, num_hidden_layers=1
    )
    return path, hf


def exact_joint(hf, prompt: list[int]) -> np.ndarray:
    """P(token 2 = a, token 3 = b) [V, V] at TEMPERATURE, marginalised over token 1."""
    v = VOCAB
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / TEMPERATURE, -1)
        seqs = torch.tensor([[*prompt, a, b] for a in range(v) for b in range(v)])
        logits = hf(seqs).logits / TEMPERATURE  # [V*V, len+2, V]
        p2 = torch.softmax(logits[:, -2], -1).view(v, v, v)[:, 0]  # [t1, t2]
        p3 = torch.softmax(logits[:, -1], -1).view(v, v, v)  # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)
    return joint.double().numpy()


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of Pearson's chi-square; cells expecting fewer than 5 draws are pooled."""
    observed, expected = observed.ravel(), expected.ravel()
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_speculative_sampling_matches_the_target_distribution(tiny):
    path, hf = tiny
    prompt = [*range(3, VOCAB), 3, 4, 5]
    spec = SpeculativeConfig(
        method="ngram", num_spec_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1
    )
    engine = InProcessEngine(
        path,
        model_and_config=load_model(path, torch.float32, "cpu"),
        speculative=spec,
        max_num_seqs=128,
        num_blocks=1024,
    )
    prompts = {f"r{i}": prompt for i in range(DRAWS)}
    for rid in prompts:
        params = SamplingParams(
            temperature=TEMPERATURE, seed=int(rid[1:]), max_tokens=3, ignore_eos=True
        )
        engine.submit(rid, prompt, params)
    out = engine.run()
    observed = np.zeros((VOCAB, VOCAB))
    for gen in out.values():
        assert len(gen.token_ids) == 3
        observed[gen.token_ids[1], gen.token_ids[2]] += 1

    stats = engine.scheduler.spec.stats
    assert stats.num_drafts >= DRAWS // 2  # most requests verified drafts
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejections

    p = chi_square_p(observed, exact_joint(hf, prompt) * DRAWS)
    assert p > 1e-3, f"speculative draws do not follow the target distribution (p={p:.2e})"
