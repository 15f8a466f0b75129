"""bad_words through the model runner on a tiny random Llama: steps launched before the last
one's tokens reached the host, a request preempted and resent with its outputs, and verify
steps of speculative decoding next to a row with words. Greedy outputs without words are the
reference: a word made of two consecutive reference tokens must stop the second one there,
and every output must keep vLLM's rule (tests/unit/worker/sampling/test_bad_words.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.plans import PlanDriver
from tests.support.tiny_llama import TINY_PROMPTS, make_tiny_llama, tiny_runner
from tests.unit.worker.sampling.test_bad_words import reference_banned

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def with_words(words: list[list[int]]) -> SamplingParams:
    return GREEDY.model_copy(update={"bad_words_token_ids": words})


def assert_keeps_the_rule(output: list[int], words: list[list[int]]) -> None:
    for i, token in enumerate(output):
        assert token not in reference_banned(words, output[:i]), (i, output)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-bad-words")
    make_tiny_llama(path)
    return path


def test_async_steps_match_words_against_tokens_still_on_the_device(tiny: Path) -> None:
    prompts = {f"r{i}": prompt for i, prompt in enumerate(TINY_PROMPTS)}
    free = {rid: g.token_ids for rid, g in InProcessEngine(tiny).generate(prompts, GREEDY).items()}
    engine = InProcessEngine(tiny)
    a, b = free["r0"], free["r2"]
    words = {"r0": [[a[4], a[5]], [a[9], a[10], a[11]]], "r2": [[b[6]]]}
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, with_words(words[rid]) if rid in words else GREEDY)
    out = {rid: g.token_ids for rid, g in engine.run(overlap=True, ahead=3).items()}
    assert engine.launched_ahead > 5  # the steps really ran ahead of their tokens
    assert out["r0"][:5] == a[:5] and out["r0"][5] != a[5]
    assert out["r2"][:6] == b[:6] and out["r2"][6] != b[6]
    for rid, row_words in words.items():
        assert_keeps_the_rule(out[rid], row_words)
    assert out["r1"] == free["r1"] and out["r3"] == free["r3"]  # rows without words


def test_a_preempted_request_resumes_its_window_from_the_outputs_resent(tiny: Path) -> None:
    def run(params: SamplingParams, preempt_after: int | None) -> list[int]:
        driver = PlanDriver(tiny_runner(tiny))
        request = driver.add("p", TINY_PROMPTS[0], params)
        driver.add("q", TINY_PROMPTS[2], GREEDY)
        if preempt_after is not None:
            for _ in range(preempt_after):
                driver.step()
            assert len(request.output) == preempt_after
            driver.preempt("p")
        driver.run()
        return request.output

    free = run(GREEDY, None)
    # The word's first token is the last output before the preemption, its second the next.
    words = [[free[3], free[4]]]
    assert_keeps_the_rule(free[:4], words)  # (so the run up to there is the free one)
    out = run(with_words(words), preempt_after=4)
    assert out[:4] == free[:4] and out[4] != free[4]
    assert_keeps_the_rule(out, words)


def test_verify_steps_record_for_a_row_with_words(tmp_path: Path) -> None:
    # Both rows speculate: the row with words draws each verify position with the drafts
    # before it in its window (SamplingState.provisional), then keeps the accepted tokens'.
    make_tiny_llama(tmp_path, vocab_size=64)  # the prompt holds nearly every token: drafts
    spec = SpeculativeConfig(method="ngram", num_spec_tokens=3, prompt_lookup_min=1)
    prompts = {"a": list(range(3, 64)), "b": [5, 9, 3, 7, 5, 9, 3, 7, 5, 9]}
    free = InProcessEngine(tmp_path, block_size=4).generate(prompts, GREEDY)["b"].token_ids
    words = [[free[5], free[6]], [free[10], free[11], free[12]]]
    outputs = []
    for speculative in (None, spec):
        engine = InProcessEngine(tmp_path, block_size=4, speculative=speculative)
        engine.submit("a", prompts["a"], GREEDY)
        engine.submit("b", prompts["b"], with_words(words))
        outputs.append({rid: g.token_ids for rid, g in engine.run().items()})
    assert engine.scheduler.spec.stats.num_draft_tokens > 0
    assert outputs[0] == outputs[1]
    assert outputs[1]["b"][:6] == free[:6] and outputs[1]["b"][6] != free[6]
    assert_keeps_the_rule(outputs[1]["b"], words)
