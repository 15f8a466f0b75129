"""n > 1 through the scheduler and the real model: sharing the prompt changes no token.

Siblings (same prompt, seeds S, S+1, ...) admitted in one step share the prompt's KV blocks:
the first computes them, the others hit them in the same step and compute only the last,
partial block. Gumbel-max noise is keyed by (seed, position, token id) only, so each sibling
must sample exactly what it samples running alone, with its whole prompt computed by itself.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.loader import load_model
from shared.protocol import SamplingParams
from tests.support.engine import Generation, InProcessEngine

BLOCK = 16
N = 4
SEED = 1234
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    # One thread: on a shared CI machine, two OpenMP threads fighting for cores run this
    # model ~10x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(smollm2_dir, torch.float32, "cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompt(smollm2_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert len(ids) > 2 * BLOCK and len(ids) % BLOCK != 0
    return ids


def params(seed: int, temperature: float) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2
    )


def siblings(ours, prompt: list[int], temperature: float) -> dict[str, Generation]:
    engine = InProcessEngine("", model_and_config=ours, block_size=BLOCK)
    for k in range(N):
        engine.submit(f"c{k}", prompt, params(SEED + k, temperature))
    got = engine.run()
    full_blocks = (len(prompt) // BLOCK) * BLOCK
    cached = [got[f"c{k}"].num_cached_tokens for k in range(N)]
    assert cached == [0] + [full_blocks] * (N - 1), "the siblings did not share the prompt"
    return got


def alone(ours, prompt: list[int], seed: int, temperature: float) -> list[int]:
    engine = InProcessEngine(
        "", model_and_config=ours, block_size=BLOCK, enable_prefix_caching=False
    )
    engine.submit("x", prompt, params(seed, temperature))
    return engine.run()["x"].token_ids


def test_sampled_siblings_equal_each_running_alone(ours, prompt):
    got = siblings(ours, prompt, temperature=0.8)
    outputs = [got[f"c{k}"].token_ids for k in range(N)]
    assert all(len(o) == NEW_TOKENS for o in outputs)
    assert len({tuple(o) for o in outputs}) == N, "different seeds should differ"
    for k in range(N):
        assert outputs[k] == alone(ours, prompt, SEED + k, 0.8), f"sibling {k}"


def test_greedy_siblings_equal_the_greedy_output(ours, prompt):
    got = siblings(ours, prompt, temperature=0.0)
    reference = alone(ours, prompt, SEED, 0.0)
    for k in range(N):
        assert got[f"c{k}"].token_ids == reference, f"sibling {k}"
