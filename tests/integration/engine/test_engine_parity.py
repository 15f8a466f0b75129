"""Scheduler core + our model vs transformers: greedy tokens identical under every schedule.

The reference is transformers' own implementation of the same SmolLM2 weights (fp32, greedy
`generate`, one prompt at a time so no padding is involved). Our side runs through the real
scheduler (batching, chunked prefill, prefix caching, preemption) and the real model runner.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.loader import load_model
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine

# The module's fixtures (two models, transformers' reference generations) take ~30 s on a quiet
# 2-core machine; under load they need more than the suite's default per-test limit.
pytestmark = pytest.mark.timeout(1800)

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain photosynthesis in one sentence.",
]
PLAIN = [
    "The quick brown fox jumps over the lazy dog, and then",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village near the mountains, there lived an old clockmaker "
    "who had never once been late for anything in his whole life. One morning,",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    out = {}
    for i, text in enumerate(CHATS):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out[f"chat{i}"] = tokenizer(chat, add_special_tokens=False)["input_ids"]
    for i, text in enumerate(PLAIN):
        out[f"plain{i}"] = tokenizer(text)["input_ids"]
    assert len({tuple(p) for p in out.values()}) == 8
    return out


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for rid, ids in prompts.items():
            gen = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=model.config.eos_token_id,
            )
            out[rid] = gen[0, len(ids) :].tolist()
    return out


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_model(smollm2_dir, torch.float32, "cpu")


def engine(ours, **kw) -> InProcessEngine:
    return InProcessEngine("", model_and_config=ours, **kw)


def test_each_prompt_alone_matches_transformers(ours, prompts, reference):
    """A batch of one, for half the prompts (two chats, two plain; every prompt runs batched
    in the other tests): the slowest test of the suite when it ran all eight."""
    eng = engine(ours)
    for rid in ("chat0", "chat3", "plain1", "plain2"):
        ids = prompts[rid]
        got = eng.generate({rid: ids}, GREEDY)
        assert got[rid].token_ids == reference[rid], rid


def test_all_eight_in_one_batch_match_transformers(ours, prompts, reference):
    eng = engine(ours)
    got = eng.generate(prompts, GREEDY)
    assert {rid: g.token_ids for rid, g in got.items()} == reference
    # they really shared steps: far fewer steps than running them one after another
    assert eng.steps < sum(len(t) for t in reference.values()) / 2


def test_chunked_prefill_matches_transformers(ours, prompts, reference):
    budget = 5  # smaller than every prompt: each prefill is split over several steps
    assert all(len(p) > budget for p in prompts.values())
    eng = engine(ours, max_num_batched_tokens=budget)
    got = eng.generate(prompts, GREEDY)
    assert {rid: g.token_ids for rid, g in got.items()} == reference
    assert eng.max_tokens_per_step <= budget


def test_prefix_hit_reuses_blocks_and_keeps_output(ours, tokenizer):
    block = 16
    shared = tokenizer("In the beginning " * 20)["input_ids"][: 3 * block]
    first = shared + tokenizer(" the sky was blue")["input_ids"]
    second = shared + tokenizer(" and then a cat appeared")["input_ids"]
    cold = engine(ours).generate({"b": second}, GREEDY)["b"].token_ids

    eng = engine(ours, block_size=block)
    seen_blocks: dict[str, list[int]] = {}
    original = eng.runner.execute

    def spy(plan):
        for new in plan.new_requests:
            seen_blocks[new.request_id] = list(new.block_ids[0])
        return original(plan)

    eng.runner.execute = spy
    eng.generate({"a": first}, GREEDY)
    got = eng.generate({"b": second}, GREEDY)["b"]
    assert got.num_cached_tokens == 3 * block
    assert seen_blocks["b"][:3] == seen_blocks["a"][:3]
    assert got.token_ids == cold


def test_free_blocks_return_after_100_requests(ours, tokenizer):
    eng = engine(ours, num_blocks=256)
    free_at_start = eng.scheduler.kv.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    base = tokenizer("Count with me: one two three four five six seven eight")["input_ids"]
    for i in range(100):
        eng.submit(f"r{i}", base + [200 + i % 50] * (1 + i % 20), params)
    got = eng.run()
    assert len(got) == 100 and all(g.finish_reason == "length" for g in got.values())
    assert eng.scheduler.kv.num_free_blocks == free_at_start


def test_preemption_keeps_every_output(ours, prompts, reference):
    # 8 requests of ~30-60 tokens + 32 new need ~40 blocks of 16; give far fewer.
    eng = engine(ours, num_blocks=14, block_size=16)
    got = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert {rid: g.token_ids for rid, g in got.items()} == reference


# Each mode once, each depth once (the four combinations cost ~4 min of CI for no other path:
# depth only changes how many plans are out, which test_async_scheduling_stops_where_sync_does
# also runs at 3 with overlap).
@pytest.mark.parametrize(
    ("overlap", "ahead"), [(False, 2), (True, 3)], ids=["planned-ahead-2", "launched-ahead-3"]
)
def test_async_scheduling_matches_transformers(ours, prompts, reference, overlap, ahead):
    """Step N+1 planned before step N's result (the worker feeds its tokens forward), with
    chunked prefill and preemption in play: the same tokens, and every block back. With
    `overlap`, step N+1 is also launched before step N is finished (the GPU worker's order):
    its inputs for N's tokens come from the device tensor of N's samples. `ahead`: plans out
    at once (SchedulerSettings.schedule_ahead)."""
    eng = engine(ours, num_blocks=14, block_size=16, max_num_batched_tokens=24)
    free_at_start = eng.scheduler.kv.num_free_blocks
    got = eng.generate(prompts, GREEDY, overlap=overlap, pipeline=True, ahead=ahead)
    assert eng.planned_ahead > NEW_TOKENS  # really pipelined, most of the way
    assert (eng.launched_ahead > NEW_TOKENS) == overlap
    assert eng.scheduler.num_preemptions > 0
    assert {rid: g.token_ids for rid, g in got.items()} == reference
    assert eng.scheduler.kv.num_free_blocks == free_at_start


def test_async_scheduling_stops_where_sync_does(ours, prompts):
    """Seeded sampling, eos and stop tokens honoured, mixed max_tokens: a request that stops
    while its next step is already planned (or launched) gets exactly the tokens of a
    step-by-step run."""
    outs = []
    for mode in ({}, {"pipeline": True}, {"overlap": True}, {"overlap": True, "ahead": 3}):
        eng = engine(ours)
        for i, (rid, ids) in enumerate(prompts.items()):
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=3 + 5 * i)
            eng.submit(rid, ids, params)
        outs.append({rid: (g.token_ids, g.finish_reason) for rid, g in eng.run(**mode).items()})
        assert not eng.scheduler.has_work()
    assert outs[0] == outs[1] == outs[2] == outs[3]
    assert {reason for _, reason in outs[0].values()} >= {"length"}
