"""EAGLE speculative decoding on SmolLM2 with a random-weight head (hidden 576), loaded from a
checkpoint dir the way a worker loads MESHLLM_SPEC_MODEL.

Greedy output with the head equals greedy output without speculation, token for token, alone
and batched. The head's incremental state (features fed step by step into its private KV
cache) is checked against a from-scratch run of the same head over the same tokens: every
draft proposed during generation must equal the draft a fresh head proposes after one
prefill over the whole prefix.

The head is random but built near the identity (fc passes the feature through, small random
layers on top): its drafts are then the target's own previous predictions, perturbed through
the head's attention, so some are accepted and multi-token catch-ups happen.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from services.worker.attention.reference import AttentionMetadata
from services.worker.loader import load_model
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.kv_cache import KVCache
from services.worker.sampling import SamplingState
from services.worker.spec import SpeculativeConfig, feature_drafter
from services.worker.spec.draft_sampler import DraftSampler
from services.worker.spec.eagle import EagleHead, random_eagle_head, save_eagle_head
from services.worker.spec.feature_drafter import FeatureDrafter
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.spec_heads import write_eagle_head

TEXTS = {"a": "The capital of France is", "b": "ha ha ha ha ha ha ha ha"}  # b: repeats
NEW_TOKENS = 8
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def near_identity_head(target_dir, max_model_len: int) -> EagleHead:
    hf = json.loads((target_dir / "config.json").read_text())
    hf.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    head = random_eagle_head(hf, max_model_len=max_model_len, seed=3, std=0.005)
    hidden = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, hidden:] += torch.eye(hidden)  # g starts as the target's feature
    return head


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    target = load_model(smollm2_dir, torch.float32)
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompts = {rid: tokenizer.encode(text).ids for rid, text in TEXTS.items()}
    head_dir = tmp_path_factory.mktemp("eagle")
    head = near_identity_head(smollm2_dir, 4096)
    save_eagle_head(head, head_dir)
    plain = InProcessEngine(smollm2_dir, model_and_config=target).generate(prompts, GREEDY)
    reference = {rid: gen.token_ids for rid, gen in plain.items()}
    return smollm2_dir, target, prompts, head_dir, reference


def eagle_engine(setup, **options: object) -> InProcessEngine:
    target_dir, target, _, head_dir, _ = setup
    spec = SpeculativeConfig(method="eagle", model=str(head_dir), num_spec_tokens=K)
    return InProcessEngine(target_dir, model_and_config=target, speculative=spec, **options)


def test_greedy_output_with_eagle_equals_plain_decoding_alone(setup) -> None:
    _, _, prompts, _, reference = setup
    engine = eagle_engine(setup)
    out = engine.generate({"a": prompts["a"]}, GREEDY)
    assert out["a"].token_ids == reference["a"]
    assert engine.scheduler.spec.stats.num_draft_tokens > 0


def test_batched_drafts_match_a_fresh_head_and_output_is_exact(setup) -> None:
    _, target, prompts, _, reference = setup
    engine = eagle_engine(setup, enable_prefix_caching=False)
    drafter = engine.runner.drafter
    assert drafter is not None and drafter.features is not None
    eagle = drafter.features
    calls: list[tuple[list[int], list[int], torch.Tensor]] = []
    propose = eagle.propose

    def recording(batch, draws):
        propose(batch, draws)
        for row, drafts in zip(draws.rows.tolist(), draws.drafts(), strict=True):
            if drafts:
                tokens = batch.token_ids[row, : batch.num_tokens[row]].tolist()
                calls.append((tokens, drafts, eagle.last[row].clone()))

    eagle.propose = recording  # type: ignore[method-assign]
    out = engine.generate(prompts, GREEDY)
    assert {rid: gen.token_ids for rid, gen in out.items()} == reference
    stats = engine.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0  # some catch-ups span accepted drafts
    assert len(calls) >= 2 * (NEW_TOKENS // (K + 1))
    for tokens, drafts, g in calls:
        fresh, fresh_g = fresh_drafts(eagle.head, target[0], tokens, len(drafts))
        # g (the head's output at the newest pair) attends over every earlier pair's KV: any
        # misplaced or stale pair moves it far beyond the float noise of other batch shapes.
        torch.testing.assert_close(g, fresh_g, atol=1e-3, rtol=1e-3)
        assert fresh == drafts


def fresh_drafts(
    head: EagleHead, target: torch.nn.Module, tokens: list[int], k: int
) -> tuple[list[int], torch.Tensor]:
    """(drafts, g at the newest pair) of a new head after one prefill over `tokens` (the
    target's features from one fresh forward over them)."""
    n = len(tokens)
    kv = KVCache.allocate(target.config, -(-n // 16), 16, torch.float32, "cpu")
    attn = AttentionMetadata.build(
        query_lens=np.array([n - 1]),
        seq_lens=np.array([n - 1]),
        block_tables=np.arange(-(-n // 16))[None, :],
        block_size=16,
        slot_mapping=np.arange(n - 1),
    )
    with torch.inference_mode():
        hidden = target(torch.tensor(tokens[:-1]), torch.arange(n - 1), attn, kv.layers)
    batch = InputBatch(1, 4096, 16)
    batch.row_req[0] = "fresh"
    batch.sampling[0] = GREEDY
    batch.token_ids[0, :n] = tokens
    batch.num_tokens[0] = n
    batch.num_computed_tokens[0] = n - 1
    vocab = target.config.vocab_size
    drafter = FeatureDrafter(head, target, vocab, 1, 4096)
    drafter.observe(batch, hidden, None, np.array([0]), np.array([n - 1]), np.array([n - 1]))
    sampler = SamplingState(1, vocab)
    sampler.add_request(0, GREEDY, tokens, [])
    draws = DraftSampler(sampler, batch, np.array([0]), np.array([k]), vocab)
    drafter.propose(batch, draws)
    return draws.drafts()[0], drafter.last[0].clone()


def seeded_after_warmup(setup, head_dir, before: list[list[int]], prompt: list[int]):
    """(tokens, the head outputs each proposal came from) of a seeded sampled `prompt` in an
    engine that first ran `before` greedily, one at a time (each takes row 0 and its blocks)."""
    target_dir, target = setup[0], setup[1]
    spec = SpeculativeConfig(method="eagle", model=str(head_dir), num_spec_tokens=K)
    engine = InProcessEngine(target_dir, model_and_config=target, speculative=spec)
    for i, warm in enumerate(before):
        engine.generate({f"warm{i}": warm}, GREEDY)
    drafter = engine.runner.drafter
    assert drafter is not None and drafter.features is not None
    eagle, kept = drafter.features, []
    propose = eagle.propose

    def recording(batch, draws):
        kept.append(eagle.last[draws.rows].clone())  # what the drafts come from
        propose(batch, draws)

    eagle.propose = recording  # type: ignore[method-assign]
    drafted = engine.scheduler.spec.stats.num_draft_tokens
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    out = engine.generate({"seeded": prompt}, seeded)["seeded"]
    assert out.num_cached_tokens >= 48
    assert engine.scheduler.spec.stats.num_draft_tokens > drafted  # its drafts verified
    return out.token_ids, torch.cat(kept)


@pytest.fixture(scope="module")
def hit_case(setup, tmp_path_factory):
    """A head whose layers are far enough from zero (std 0.02, as the e2e suite's) for its
    attention to see a hit's positions; a prompt of 6 blocks and an unrelated longer one."""
    target_dir = setup[0]
    head_dir = write_eagle_head(target_dir, tmp_path_factory.mktemp("eagle02") / "h", identity=True)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    cached, other = (
        tokenizer.encode(" ".join([text] * n)).ids
        for text, n in (("The old mill by the river ground wheat for the village.", 8), ("ha", 200))
    )
    return head_dir, cached, other


def test_a_prefix_hit_drafts_from_the_request_own_tokens_only(setup, hit_case) -> None:
    """A prefix-cache hit leaves the head positions of the cached tokens without target
    features. What the head holds there must not be what an earlier request of the same row
    wrote into the same pool blocks: a seeded sampled request (sampled drafts, rejection
    sampling) drafts from the same head outputs, and so gives the same tokens, after an
    unrelated request used its row as after none."""
    head_dir, cached, other = hit_case
    tokens, heads = seeded_after_warmup(setup, head_dir, [cached, other], cached)
    alone_tokens, alone_heads = seeded_after_warmup(setup, head_dir, [cached], cached)
    assert tokens == alone_tokens
    torch.testing.assert_close(heads, alone_heads, rtol=1e-5, atol=1e-6)


def test_the_fill_in_chunks_equals_one_pass(setup, hit_case, monkeypatch) -> None:
    """The hit's positions filled a few at a time (FILL_CHUNK 7, which divides no block, so
    the last chunk is a partial one) give the head the state one pass gives."""
    head_dir, cached, _ = hit_case
    one_pass = seeded_after_warmup(setup, head_dir, [cached], cached)
    monkeypatch.setattr(feature_drafter, "FILL_CHUNK", 7)
    chunked = seeded_after_warmup(setup, head_dir, [cached], cached)
    assert chunked[0] == one_pass[0]
    torch.testing.assert_close(chunked[1], one_pass[1], rtol=1e-4, atol=1e-5)
