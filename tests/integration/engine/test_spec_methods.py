"""Every model drafter through the scheduler core and the model runner, on a tiny random Llama
and drafters saved as checkpoints the way their users' tools write them (tests/support/
spec_heads.py): a separate draft model, EAGLE-1/2, EAGLE-3 in both formats, MTP modules in the
target's own checkpoint, a DFlash draft (one non-causal block forward per proposal).

- Greedy output equals transformers' greedy output of the target, token for token, alone and
  batched, with drafts really verified.
- Seeded sampled output is reproducible and does not change when other requests join the
  batch (drafts, acceptances and corrections are all keyed by seed and position).
- Sampled drafts are verified by rejection sampling: a draft model equal to the target (q = p)
  has nearly every sampled draft accepted, where the same-noise rule would accept only
  sum(p^2) of them. With tokens arriving several per step, logprobs are still the target's
  log_softmax at each emitted token (transformers' fp32 forward), and a stop token inside an
  accepted run ends the output there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.loader import load_model
from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
)
from tests.support.tiny_llama import make_tiny_llama, reference_greedy

pytestmark = pytest.mark.timeout(900)

PROMPTS = {"a": [5, 17, 99, 3, 250, 41], "b": [7, 7, 300, 12], "c": list(range(20, 45))}
NEW_TOKENS = 12
K = 3
#: method label -> (SPEC_METHOD, drafter dir under the fixture root, target dir to serve)
DRAFTERS = {
    "draft": ("draft", "draft", "target"),
    "eagle": ("eagle", "eagle", "target"),
    "eagle3": ("eagle3", "eagle3", "target"),
    "eagle3-speculators": ("eagle3", "eagle3s", "target"),
    "mtp": ("mtp", "mtp", "mtp"),
    "dflash": ("dflash", "dflash", "target"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spec_methods")
    target = root / "target"
    hf = make_tiny_llama(target, seed=0)
    make_tiny_llama(root / "draft", seed=1, num_hidden_layers=1)
    write_eagle_head(target, root / "eagle", identity=True)
    write_eagle3_head(target, root / "eagle3", draft_vocab_size=128, identity=True)
    write_eagle3_head(target, root / "eagle3s", speculators=True, identity=True)
    write_mtp_target(target, root / "mtp", identity=True)
    write_dflash_draft(target, root / "dflash", block_size=K + 1)
    reference = {rid: reference_greedy(hf, p, NEW_TOKENS) for rid, p in PROMPTS.items()}
    return root, reference


def engine(root: Path, label: str, on_worker: bool = False) -> InProcessEngine:
    method, drafter, target = DRAFTERS[label]
    spec = SpeculativeConfig(method=method, model=str(root / drafter), num_spec_tokens=K)
    return InProcessEngine(
        root / target,
        model_and_config=load_model(root / target, torch.float32),
        speculative=spec,
        scheduler_options={"spec_drafts_on_worker": on_worker},
    )


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("label", list(DRAFTERS))
def test_greedy_output_equals_the_target_alone_and_batched(root, label: str) -> None:
    path, reference = root
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = engine(path, label)
    assert alone.generate({"c": PROMPTS["c"]}, greedy)["c"].token_ids == reference["c"]
    batched = engine(path, label)
    out = batched.generate(PROMPTS, greedy)
    assert {rid: gen.token_ids for rid, gen in out.items()} == reference
    assert batched.scheduler.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("label", list(DRAFTERS))
def test_seeded_sampling_is_reproducible_and_batch_invariant(root, label: str) -> None:
    path, _ = root
    alone = engine(path, label).generate({"a": PROMPTS["a"]}, sampled(7))["a"].token_ids
    again = engine(path, label).generate({"a": PROMPTS["a"]}, sampled(7))["a"].token_ids
    assert again == alone
    batch = engine(path, label)
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        batch.submit(rid, prompt, sampled(7 if rid == "a" else 100 + i))
    out = batch.run()
    assert out["a"].token_ids == alone
    assert batch.scheduler.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("label", list(DRAFTERS))
def test_drafts_on_the_worker_planned_ahead_verify_the_same_drafts(root, label: str) -> None:
    """The mesh's way with asynchronous scheduling (the worker verifies its own drafts in
    lookahead slots planned up to three steps ahead) gives the seeded sampled output of
    drafts carried by the plans one step at a time: the same drafts are verified, none cut
    short by slots still in flight near max_tokens (rejection sampling's output depends on
    how many drafts a step verifies)."""
    path, _ = root
    params = {rid: sampled(100 + i) for i, rid in enumerate(PROMPTS)}
    carried = engine(path, label)
    ahead = engine(path, label, on_worker=True)
    for rid, prompt in PROMPTS.items():
        carried.submit(rid, prompt, params[rid])
        ahead.submit(rid, prompt, params[rid])
    want = carried.run()
    got = ahead.run(pipeline=True, ahead=3)
    assert {r: g.token_ids for r, g in got.items()} == {r: g.token_ids for r, g in want.items()}
    assert ahead.planned_ahead > 0
    assert (
        ahead.scheduler.spec.stats.num_draft_tokens
        == carried.scheduler.spec.stats.num_draft_tokens
        > 0
    )


def test_a_draft_equal_to_the_target_has_its_sampled_drafts_accepted(root) -> None:
    path, _ = root
    spec = SpeculativeConfig(method="draft", model=str(path / "target"), num_spec_tokens=K)
    target = path / "target"
    run = InProcessEngine(
        target, model_and_config=load_model(target, torch.float32), speculative=spec
    )
    run.generate(PROMPTS, sampled(3))
    stats = run.scheduler.spec.stats
    assert stats.num_draft_tokens >= 3 * (NEW_TOKENS // (K + 1))
    assert stats.acceptance_rate > 0.9


def test_logprobs_and_stops_with_accepted_sampled_drafts(root) -> None:
    path, _ = root
    target = path / "target"
    spec = SpeculativeConfig(method="draft", model=str(target), num_spec_tokens=K)

    def run(params: SamplingParams) -> tuple[list[int], list[float], str | None]:
        eng = InProcessEngine(
            target, model_and_config=load_model(target, torch.float32), speculative=spec
        )
        gen = eng.generate({"a": PROMPTS["a"]}, params)["a"]
        assert eng.scheduler.spec.stats.num_accepted_tokens > 0
        return gen.token_ids, gen.logprobs, gen.finish_reason

    with_logprobs = SamplingParams(
        temperature=1.0, seed=9, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2
    )
    tokens, logprobs, _ = run(with_logprobs)
    assert len(logprobs) == len(tokens) == NEW_TOKENS
    hf = transformers_model(target)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS["a"] + tokens])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(PROMPTS["a"]) - 1 : -1]
    expected = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=1e-4)

    stop = tokens[6]
    cut = tokens.index(stop) + 1
    stopped, _, reason = run(with_logprobs.model_copy(update={"stop_token_ids": [stop]}))
    assert stopped == tokens[:cut] and reason == "stop"


def transformers_model(path: Path):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
