"""Seeded sampling with speculation samples the target's distribution, for every drafter:
chi-square of many draws on a tiny random model against the exact distribution from
transformers.

Tokens 2 and 3 of each output come out of verification steps, so both acceptance and the draw
after a rejection shape them; the test checks their joint distribution. n-gram drafts are point
masses (prompt lookup with n = 1 always finds one: the prompt holds every token), verified with
the target's own noise; the model drafters' drafts are sampled at the request's temperature
and verified by rejection sampling (services/worker/spec/verify.py). Their heads are random and
their drafts peaked, so q is far from p: many rejections, residuals far from p, and a rule that
drew the correction from p (or accepted with p/q the wrong way round) fails the test.

With a grammar the scheduler trims drafts at the first one the grammar rejects, a trim that
depends on the draft's value: the worker still checks the trimmed draft against the step's last
row (services/worker/spec/proposals.py), and the output follows the grammar-masked target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.grammar.compiler_process import compile_grammar
from services.grammar.grammar_spec import compile_job
from services.worker.loader import load_model
from services.worker.spec import SpeculativeConfig
from shared.protocol import GrammarRef, SamplingParams, SubmitRequest
from tests.support.engine import InProcessEngine
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
)
from tests.support.tiny_llama import make_tiny_llama

pytestmark = pytest.mark.timeout(1800)

VOCAB = 16
DRAWS = 600
TEMPERATURE = 1.0
PROMPT = [*range(3, VOCAB), 3, 4, 5]
#: the grammar test's language: characters d..i, i.e. tokens 3..8 (token 2 is the stop token);
#: chosen with the draft below so that trims are frequent and the residual far from p (a worker
#: that let a trimmed draft's token come from p instead would be off by ~0.2 in total variation
#: on token 2), with enough draws to see it
REGEX = "[d-i]{8}"
ALLOWED = list(range(3, 9))
GRAMMAR_DRAWS = 1500


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tiny_spec")
    target = root / "target"
    # A small init spread keeps the distribution wide: many distinct draws, many rejections.
    hf = make_tiny_llama(
        target, seed=3, vocab_size=VOCAB, initializer_range=0.08, num_hidden_layers=1
    )
    # The draft model is the target with its logits tripled: drafts peaked on the target's
    # likely tokens, so the correction after a rejection (the residual, far from p) matters.
    draft = make_tiny_llama(
        root / "draft", seed=3, vocab_size=VOCAB, initializer_range=0.08, num_hidden_layers=1
    )
    with torch.no_grad():
        draft.lm_head.weight.mul_(3.0)
    draft.save_pretrained(root / "draft")
    # Large weights make peaked drafts: q far from p.
    write_eagle_head(target, root / "eagle", std=1.0)
    # Half the target's vocabulary (d2t: every other token); the target has one layer, so the
    # head names its own auxiliary layers.
    write_eagle3_head(target, root / "eagle3", std=1.0, draft_vocab_size=8, aux_layers=(0, 0, 0))
    write_mtp_target(target, root / "mtp", std=1.0)
    # A DFlash draft reads a target layer's output stream, which a one-layer target lacks (its
    # only layer's output is the final one): the same shape with two layers, read after the
    # first.
    make_tiny_llama(
        root / "target2", seed=3, vocab_size=VOCAB, initializer_range=0.08, num_hidden_layers=2
    )
    write_dflash_draft(root / "target2", root / "dflash", std=1.0, block_size=3, target_layers=(0,))
    return root, hf


def spec_for(root: Path, method: str) -> tuple[SpeculativeConfig, Path]:
    """(the method's config, the target dir to serve)."""
    if method == "ngram":
        spec = SpeculativeConfig(
            method="ngram", num_spec_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1
        )
        return spec, root / "target"
    target = root / {"mtp": "mtp", "dflash": "target2"}.get(method, "target")
    model = {"draft": "draft", "eagle": "eagle", "eagle3": "eagle3", "mtp": "mtp"}.get(
        method, method
    )
    return SpeculativeConfig(method=method, num_spec_tokens=2, model=str(root / model)), target


def exact_joint(hf, prompt: list[int], allowed: list[int] | None = None) -> np.ndarray:
    """P(token 2 = a, token 3 = b) [V, V] at TEMPERATURE, marginalised over token 1; with
    `allowed`, every position's distribution is restricted to those tokens."""
    v = VOCAB
    mask = torch.zeros(v)
    if allowed is not None:
        mask = torch.full((v,), float("-inf"))
        mask[allowed] = 0.0
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / TEMPERATURE + mask, -1)
        seqs = torch.tensor([[*prompt, a, b] for a in range(v) for b in range(v)])
        logits = hf(seqs).logits / TEMPERATURE + mask  # [V*V, len+2, V]
        p2 = torch.softmax(logits[:, -2], -1).view(v, v, v)[:, 0]  # [t1, t2]
        p3 = torch.softmax(logits[:, -1], -1).view(v, v, v)  # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)
    return joint.double().numpy()


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of Pearson's chi-square; cells expecting fewer than 5 draws are pooled (a draw
    in a cell of probability 0 gives p = 0)."""
    observed, expected = observed.ravel(), expected.ravel()
    if (observed[expected == 0] > 0).any():
        return 0.0
    small = expected < 5
    obs, exp = observed[~small], expected[~small]
    if expected[small].sum() > 0:
        obs = np.append(obs, observed[small].sum())
        exp = np.append(exp, expected[small].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def run_draws(
    root: Path, method: str, grammar: object = None, draws: int = DRAWS
) -> tuple[np.ndarray, InProcessEngine]:
    spec, target = spec_for(root, method)
    engine = InProcessEngine(
        target,
        model_and_config=load_model(target, torch.float32, "cpu"),
        speculative=spec,
        max_num_seqs=128,
        num_blocks=1024,
    )
    for i in range(draws):
        params = SamplingParams(temperature=TEMPERATURE, seed=i, max_tokens=3, ignore_eos=True)
        ref = GrammarRef(kind="regex", spec=REGEX, key="g") if grammar is not None else None
        msg = SubmitRequest(
            request_id=f"r{i}", prompt_token_ids=PROMPT, sampling=params, reply_stream="r",
            grammar=ref,
        )  # fmt: skip
        assert engine.scheduler.add_request(msg, grammar) is None  # type: ignore[arg-type]
    observed = np.zeros((VOCAB, VOCAB))
    for gen in engine.run().values():
        assert len(gen.token_ids) == 3
        observed[gen.token_ids[1], gen.token_ids[2]] += 1
    return observed, engine


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "eagle3", "mtp", "dflash"])
def test_speculative_sampling_matches_the_target_distribution(tiny, method: str) -> None:
    root, hf = tiny
    if method == "dflash":
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(root / "target2", dtype=torch.float32).eval()
    observed, engine = run_draws(root, method)
    drafter = engine.runner.drafter
    assert drafter is not None and drafter.config.method == method
    stats = engine.scheduler.spec.stats
    assert stats.num_drafts >= DRAWS // 2  # most requests verified drafts
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejections
    expected = exact_joint(hf, PROMPT) * DRAWS
    for name, obs, exp in (
        ("token 2", observed.sum(1), expected.sum(1)),
        ("joint", observed, expected),
    ):
        p = chi_square_p(obs, exp)
        assert p > 1e-3, f"{method}: {name} does not follow the target distribution (p={p:.2e})"


def test_grammar_trimmed_sampled_drafts_keep_the_masked_distribution(tiny) -> None:
    import xgrammar as xgr

    root, hf = tiny
    info = xgr.TokenizerInfo(
        [chr(ord("a") + i) for i in range(VOCAB)], vocab_type=xgr.VocabType.RAW, stop_token_ids=[2]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammar = compile_grammar(compiler, compile_job("regex", REGEX))
    observed, engine = run_draws(root, "draft", grammar, GRAMMAR_DRAWS)
    assert set(np.flatnonzero(observed.sum(1))) <= set(ALLOWED)
    assert set(np.flatnonzero(observed.sum(0))) <= set(ALLOWED)
    stats = engine.scheduler.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    expected = exact_joint(hf, PROMPT, ALLOWED) * GRAMMAR_DRAWS
    for name, obs, exp in (
        ("token 2", observed.sum(1), expected.sum(1)),
        ("joint", observed, expected),
    ):
        p = chi_square_p(obs, exp)
        assert p > 1e-3, f"{name} does not follow the masked distribution (p={p:.2e})"
