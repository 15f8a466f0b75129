"""n-gram speculative decoding on SmolLM2 through the scheduler core and the model runner:
greedy output equals greedy output without speculation, token for token, alone and batched;
seeded sampling too (the verification reuses the target's own noise, services/worker/spec).
Each comparison also checks that drafts were really verified and accepted."""

from __future__ import annotations

import pytest
import torch

from services.worker.loader import load_model
from services.worker.runner.input_batch import PlanError
from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine

pytestmark = pytest.mark.timeout(900)

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
NGRAM = SpeculativeConfig(method="ngram", num_spec_tokens=4)
CHATS = [
    "Repeat this sentence exactly: the cat sat on the warm mat next to the door.",
    "Fix the typo and print the code again:\ndef add(a, b):\n    retrun a + b\n",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def model_and_config(smollm2_dir):
    return load_model(smollm2_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    out = {}
    for i, text in enumerate(CHATS):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out[f"chat{i}"] = tokenizer(chat, add_special_tokens=False)["input_ids"]
    return out


def engine(smollm2_dir, model_and_config, spec: SpeculativeConfig | None) -> InProcessEngine:
    return InProcessEngine(smollm2_dir, model_and_config=model_and_config, speculative=spec)


@pytest.fixture(scope="module")
def baseline(smollm2_dir, model_and_config, prompts) -> dict[str, list[int]]:
    out = engine(smollm2_dir, model_and_config, None).generate(prompts, GREEDY)
    return {rid: gen.token_ids for rid, gen in out.items()}


def test_greedy_alone_equals_no_speculation(smollm2_dir, model_and_config, prompts, baseline):
    rid = "chat0"  # copy-heavy: most drafts stand
    spec = engine(smollm2_dir, model_and_config, NGRAM)
    out = spec.generate({rid: prompts[rid]}, GREEDY)
    assert out[rid].token_ids == baseline[rid]
    stats = spec.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0
    assert spec.steps < len(baseline[rid])  # several tokens per step


def test_greedy_batched_equals_no_speculation(smollm2_dir, model_and_config, prompts, baseline):
    spec = engine(smollm2_dir, model_and_config, NGRAM)
    out = spec.generate(prompts, GREEDY)
    assert {rid: gen.token_ids for rid, gen in out.items()} == baseline
    stats = spec.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections were exercised too


SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=NEW_TOKENS)


@pytest.mark.parametrize(
    "params",
    [
        SEEDED,  # every position's draws in one sampler call
        # top-k and top logprobs in that one call; a logit bias (a per-entry stage) makes the
        # verify step draw one position per call instead: both must equal plain decoding.
        SEEDED.model_copy(update={"top_k": 40, "logprobs": 2}),
        SEEDED.model_copy(update={"logit_bias": {13: 1.5}, "logprobs": 2}),
    ],
    ids=["seeded", "topk-logprobs", "logit-bias"],
)
def test_seeded_sampling_equals_no_speculation(smollm2_dir, model_and_config, prompts, params):
    chosen = {rid: prompts[rid] for rid in ("chat0", "chat1")}
    plain = engine(smollm2_dir, model_and_config, None).generate(chosen, params)
    spec = engine(smollm2_dir, model_and_config, NGRAM)
    out = spec.generate(chosen, params)
    assert {r: g.token_ids for r, g in out.items()} == {r: g.token_ids for r, g in plain.items()}
    assert spec.scheduler.spec.stats.num_accepted_tokens > 0
    if params.logprobs:
        for rid, gen in out.items():
            ref = plain[rid]
            assert gen.top_token_ids == ref.top_token_ids
            assert len(gen.top_token_ids) == 2 * len(gen.token_ids) > 0
            torch.testing.assert_close(gen.logprobs, ref.logprobs, rtol=0, atol=1e-4)
            torch.testing.assert_close(gen.top_logprobs, ref.top_logprobs, rtol=0, atol=1e-4)


def history_params(kind: str, baseline: dict[str, list[int]]) -> SamplingParams:
    """Sampling that reads what was output: each verify position must see the drafts before
    it as outputs."""
    if kind == "penalties-greedy":
        return GREEDY.model_copy(update={"repetition_penalty": 1.3, "presence_penalty": 0.4})
    if kind == "penalties-seeded":
        return SEEDED.model_copy(
            update={"repetition_penalty": 1.2, "frequency_penalty": 0.3, "logprobs": 2}
        )
    if kind == "min-tokens":  # chat2 ends before 16 tokens unless held to it
        return GREEDY.model_copy(update={"min_tokens": NEW_TOKENS})
    # bad words: chat0's free output with a two-token word of it banned from position 5 on
    word = baseline["chat0"][4:6]
    return GREEDY.model_copy(update={"bad_words_token_ids": [word]})


@pytest.mark.parametrize(
    "kind", ["penalties-greedy", "penalties-seeded", "min-tokens", "bad-words"]
)
def test_sampling_that_reads_the_outputs_equals_no_speculation(
    smollm2_dir, model_and_config, prompts, baseline, kind: str
):
    params = history_params(kind, baseline)
    plain = engine(smollm2_dir, model_and_config, None).generate(prompts, params)
    spec = engine(smollm2_dir, model_and_config, NGRAM)
    out = spec.generate(prompts, params)
    assert {r: g.token_ids for r, g in out.items()} == {r: g.token_ids for r, g in plain.items()}
    assert spec.scheduler.spec.stats.num_accepted_tokens > 0
    if kind == "min-tokens":
        assert len(baseline["chat2"]) < NEW_TOKENS == len(out["chat2"].token_ids)
    if kind == "bad-words":
        assert out["chat0"].token_ids[:4] == baseline["chat0"][:4]
        assert out["chat0"].token_ids != baseline["chat0"]
    if params.logprobs:
        for rid, gen in out.items():
            assert gen.top_token_ids == plain[rid].top_token_ids
            torch.testing.assert_close(gen.logprobs, plain[rid].logprobs, rtol=0, atol=1e-4)


def drafting_on_worker(
    smollm2_dir, model_and_config, chain: bool, **options: object
) -> InProcessEngine:
    """n-gram drafts verified by the worker in lookahead slots (as the mesh plans with async
    scheduling); `chain`: its verify steps chained on the device (spec/chain.py)."""
    return InProcessEngine(
        smollm2_dir,
        model_and_config=model_and_config,
        speculative=NGRAM,
        scheduler_options={"spec_drafts_on_worker": True},
        runner_options={"device_chain": chain},
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("chain", [False, True], ids=["on-host", "chained-on-device"])
@pytest.mark.parametrize(
    "params",
    [GREEDY, SEEDED, SEEDED.model_copy(update={"presence_penalty": 0.5})],
    ids=["greedy", "seeded", "penalized"],  # penalized: verified on the host, chain or not
)
def test_drafts_on_the_worker_planned_ahead_equal_no_speculation(
    smollm2_dir, model_and_config, prompts, params, chain: bool
):
    """What the mesh does with asynchronous scheduling: lookahead slots planned up to three
    steps ahead of the results (the scheduler counts them all as accepted until each result),
    the worker verifying its own drafts in them; chained on the device (spec/chain.py), each
    step launched, as a GPU worker launches it, before the previous one's tokens are on the
    host. Output equals plain decoding, token for token, with exactly max_tokens tokens."""
    plain_engine = engine(smollm2_dir, model_and_config, None)
    plain = plain_engine.generate(prompts, params, pipeline=True, ahead=3)
    spec = drafting_on_worker(smollm2_dir, model_and_config, chain)
    out = spec.generate(prompts, params, pipeline=True, overlap=chain, ahead=3)
    assert {r: g.token_ids for r, g in out.items()} == {r: g.token_ids for r, g in plain.items()}
    assert spec.planned_ahead > 0  # verify steps went out before the previous result
    # and were launched before it was finished, unless the sampling reads what was output
    # (a penalty): then each verify step waits for the tokens before it
    assert (spec.launched_ahead > 0) == (chain and not params.presence_penalty)
    stats = spec.scheduler.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if params is GREEDY:  # the copying prompt's drafts stand: fewer steps in all
        assert spec.steps < plain_engine.steps
    for request in spec.scheduler.requests.values():  # nothing left over (all finished)
        raise AssertionError(f"{request.request_id} still held")


@pytest.mark.parametrize("chain", [False, True], ids=["on-host", "chained-on-device"])
def test_drafts_on_the_worker_with_chunking_and_preemption(
    smollm2_dir, model_and_config, prompts, chain: bool
):
    """Lookahead slots in flight when a request is preempted (a pool too small for the batch)
    or its prompt comes in chunks (a small step budget): the outputs still equal plain
    decoding's, and every block comes back. Chained on the device (spec/chain.py), the steps
    that run on the host in between append tokens the device's copy must take up."""
    small = {"num_blocks": 10, "block_size": 16, "max_num_batched_tokens": 24}
    plain = InProcessEngine(smollm2_dir, model_and_config=model_and_config, **small)
    want = plain.generate(prompts, GREEDY)
    spec = drafting_on_worker(smollm2_dir, model_and_config, chain, **small)
    free_at_start = spec.scheduler.kv.num_free_blocks
    got = spec.generate(prompts, GREEDY, pipeline=True, overlap=chain, ahead=3)
    assert {r: g.token_ids for r, g in got.items()} == {r: g.token_ids for r, g in want.items()}
    assert spec.scheduler.num_preemptions > 0 and spec.planned_ahead > 0
    assert spec.launched_ahead > 0 or not chain
    assert spec.scheduler.spec.stats.num_accepted_tokens > 0
    assert spec.scheduler.kv.num_free_blocks == free_at_start


def test_a_host_step_behind_a_chained_step_in_flight_is_refused(
    smollm2_dir, model_and_config, prompts
):
    """The host's copy of a row is behind the device's while a chained step is in flight, so a
    step that runs on the host (here a new prompt's prefill beside the decoding request) must
    not launch behind it: PlanError (the service finishes the chained step first; this guards
    against a plan that got past can_overlap)."""
    spec = drafting_on_worker(smollm2_dir, model_and_config, True)
    spec.submit("a", prompts["chat0"], GREEDY)
    first = spec.scheduler.schedule()
    assert first is not None
    spec.scheduler.update_from_output(first, spec.runner.execute(first))
    chained = spec.scheduler.schedule()
    assert chained is not None and spec.runner.can_overlap(chained)
    in_flight = spec.runner.launch(chained)
    spec.submit("b", prompts["chat1"], GREEDY)
    host_step = spec.scheduler.schedule()
    assert host_step is not None and not spec.runner.can_overlap(host_step)
    with pytest.raises(PlanError, match="chained verify steps are in flight"):
        spec.runner.launch(host_step)
    assert spec.runner.finish(in_flight).sampled  # the chained step itself still lands
