"""Prompt logprobs (echo + logprobs, lm-eval's loglikelihood requests) from the scheduler core
and the model runner against transformers' own log-softmax over the same SmolLM2 weights
(fp32): every prompt token after the first, and its top alternatives, under chunked prefill,
preemption, a prompt already in the prefix cache, and steps planned and launched ahead."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.worker.loader import load_model
from shared.protocol import SamplingParams
from tests.support.engine import Generation, InProcessEngine

pytestmark = pytest.mark.timeout(900)

K = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, logprobs=K, prompt_logprobs=K)
PREEMPTING = PARAMS.model_copy(update={"max_tokens": 24, "ignore_eos": True})
TEXTS = {
    "fox": "The quick brown fox jumps over the lazy dog, and then it ran into the forest",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "tale": "Once upon a time, in a small village near the mountains, there lived an old "
    "clockmaker who had never once been late for anything in his whole life.",
}


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Any) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return {rid: tok(text)["input_ids"] for rid, text in TEXTS.items()}


@pytest.fixture(scope="module")
def reference(smollm2_dir: Any, prompts: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """[P - 1, vocab] log-softmax of transformers' logits at positions 0 .. P - 2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return {
            rid: torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            for rid, ids in prompts.items()
        }


@pytest.fixture(scope="module")
def ours(smollm2_dir: Any) -> Any:
    return load_model(smollm2_dir, torch.float32, "cpu")


def check(got: Generation, ids: list[int], ref: torch.Tensor) -> None:
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(ids) - 1
    expected = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(got.prompt_logprobs), expected, atol=2e-4, rtol=0)
    top = torch.topk(ref, K, dim=-1)
    got_top = torch.tensor(got.prompt_top_logprobs).view(-1, K)
    assert torch.allclose(got_top, top.values, atol=2e-4, rtol=0)
    got_ids = torch.tensor(got.prompt_top_token_ids).view(-1, K)
    assert (got_ids[:, 0] == top.indices[:, 0]).float().mean() > 0.95  # ties may swap
    # Ranks: the tokens at least as likely as the prompt's (vLLM's). Near-ties may differ by
    # the fp32 noise between the two forwards, so compare with a margin.
    ranks = torch.tensor(got.prompt_ranks)
    assert ranks.shape == expected.shape and bool((ranks >= 1).all())
    low = (ref >= expected[:, None] + 1e-3).sum(dim=-1)
    high = (ref >= expected[:, None] - 1e-3).sum(dim=-1)
    assert bool(((low <= ranks) & (ranks <= high)).all())
    assert len(set(ranks.tolist())) > 3  # not a constant


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},  # every prompt prefilled over several steps
        {"num_blocks": 20, "block_size": 4},  # preemptions (PREEMPTING decodes 24 tokens)
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_match_transformers(
    ours: Any, prompts: dict[str, list[int]], reference: dict[str, torch.Tensor], options: dict
) -> None:
    eng = InProcessEngine("", model_and_config=ours, **options)
    got = eng.generate(prompts, PREEMPTING if "num_blocks" in options else PARAMS)
    for rid, ids in prompts.items():
        check(got[rid], ids, reference[rid])
    if "num_blocks" in options:
        assert eng.scheduler.num_preemptions > 0


def test_a_cached_prompt_is_computed_again(
    ours: Any, prompts: dict[str, list[int]], reference: dict[str, torch.Tensor]
) -> None:
    eng = InProcessEngine("", model_and_config=ours, block_size=4)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    assert eng.generate({"warm": prompts["tale"]}, plain)["warm"].prompt_logprobs is None
    again = eng.generate({"tale": prompts["tale"]}, PARAMS)["tale"]
    assert again.num_cached_tokens == 0  # no prefix hit: every position is computed
    check(again, prompts["tale"], reference["tale"])


@pytest.mark.parametrize("overlap", [False, True], ids=["planned-ahead", "launched-ahead"])
def test_prompt_logprobs_with_steps_ahead(
    ours: Any,
    prompts: dict[str, list[int]],
    reference: dict[str, torch.Tensor],
    overlap: bool,
) -> None:
    eng = InProcessEngine("", model_and_config=ours, max_num_batched_tokens=9)
    got = eng.generate(prompts, PARAMS, pipeline=True, overlap=overlap, ahead=3)
    for rid, ids in prompts.items():
        check(got[rid], ids, reference[rid])
