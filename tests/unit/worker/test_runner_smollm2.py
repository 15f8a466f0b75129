"""ModelRunner on the real SmolLM2-135M-Instruct: greedy tokens identical to transformers'
`generate` (fp32) alone, batched and with chunked prefill; first-step logits within 1e-4; bf16
close at bf16 tolerance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.loader import load_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from shared.protocol import SamplingParams
from tests.support.plans import PlanDriver
from tests.support.tiny_llama import LogitsCapture, reference_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One intra-op thread: the dev machine's 2 cores are shared, and two OpenMP threads
    spinning against other processes make every step many times slower. It also fixes the
    GEMM partitioning, so the fp32 rounding compared below does not vary with the load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain in one paragraph why the sky is blue.",
]
PLAIN = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the mountains, there lived",
    "1, 2, 3, 4, 5,",
]


@dataclass
class Reference:
    prompts: list[list[int]]
    tokens: list[list[int]]  # transformers greedy generate, 32 tokens or up to eos
    last_logits: torch.Tensor  # [8, vocab]: logits at each prompt's last position


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> Reference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts: list[list[int]] = []
    for text in CHAT:
        ids: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    prompts += [tokenizer(text)["input_ids"] for text in PLAIN]
    tokens = [reference_greedy(model, p, MAX_TOKENS) for p in prompts]
    with torch.no_grad():
        last = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    return Reference(prompts, tokens, last)


@pytest.fixture(scope="module")
def fp32_model(smollm2_dir: Path) -> tuple[Any, Any]:
    return load_model(smollm2_dir, torch.float32, max_model_len=512)


def make_runner(model_and_config: tuple[Any, Any], num_blocks: int = 256) -> ModelRunner:
    model, config = model_and_config
    dtype = next(model.parameters()).dtype
    kv = KVCache.allocate(config, num_blocks, 16, dtype, "cpu")
    return ModelRunner(model, config, kv, max_num_reqs=16, max_model_len=512)


def test_reference_is_meaningful(reference: Reference) -> None:
    assert len({tuple(p) for p in reference.prompts}) == 8
    assert sum(len(t) for t in reference.tokens) > 8 * 8  # not all stopping at once


def test_each_prompt_alone(fp32_model: tuple[Any, Any], reference: Reference) -> None:
    for i, (prompt, expected) in enumerate(zip(reference.prompts, reference.tokens, strict=True)):
        runner = make_runner(fp32_model)
        capture = LogitsCapture(runner)
        driver = PlanDriver(runner)
        request = driver.add("alone", prompt, GREEDY)
        driver.run()
        assert request.output == expected
        error = (capture.calls[0][0] - reference.last_logits[i]).abs().max().item()
        assert error < 1e-4, (i, error)


def test_all_eight_in_one_batch_and_first_step_logits(
    fp32_model: tuple[Any, Any], reference: Reference
) -> None:
    runner = make_runner(fp32_model)
    capture = LogitsCapture(runner)
    driver = PlanDriver(runner, token_budget=4096)
    requests = [driver.add(f"r{i}", p, GREEDY) for i, p in enumerate(reference.prompts)]
    first = driver.step()
    assert [s.request_id for s in first.sampled] == [f"r{i}" for i in range(8)]
    error = (capture.calls[0] - reference.last_logits).abs().max().item()
    assert error < 1e-4, error
    driver.run()
    for request, expected in zip(requests, reference.tokens, strict=True):
        assert request.output == expected, request.request_id


def test_chunked_prefill_mixed_with_decodes(
    fp32_model: tuple[Any, Any], reference: Reference
) -> None:
    driver = PlanDriver(make_runner(fp32_model), chunk_size=8, token_budget=24)
    requests = {}
    for i, prompt in enumerate(reference.prompts):
        requests[i] = driver.add(f"r{i}", prompt, GREEDY)
        driver.step()  # staggered arrivals: earlier requests decode while later ones prefill
        driver.step()
    driver.run()
    chunked = [p for p in driver.plans if any(n == 8 for n in p.num_scheduled_tokens.values())]
    assert any(1 in p.num_scheduled_tokens.values() for p in chunked)  # chunk next to a decode
    for i, expected in enumerate(reference.tokens):
        assert requests[i].output == expected, i


def test_bfloat16_logits_close_and_tokens_mostly_equal(
    smollm2_dir: Path, reference: Reference
) -> None:
    runner = make_runner(load_model(smollm2_dir, torch.bfloat16, max_model_len=512))
    assert runner.kv_cache.layers[0].dtype == torch.bfloat16
    capture = LogitsCapture(runner)
    driver = PlanDriver(runner, token_budget=4096)
    requests = [driver.add(f"r{i}", p, GREEDY) for i, p in enumerate(reference.prompts)]
    driver.run()
    logits = capture.calls[0].float()
    # bf16 keeps ~3 significant digits through 30 layers: compare against the logit scale
    scale = reference.last_logits.abs().max().item()
    assert (logits - reference.last_logits).abs().max().item() < 0.05 * scale
    assert (logits.argmax(-1) == reference.last_logits.argmax(-1)).float().mean() >= 0.75
    same = sum(
        a == b
        for request, expected in zip(requests, reference.tokens, strict=True)
        for a, b in zip(request.output, expected, strict=False)
    )
    total = sum(min(len(r.output), len(e)) for r, e in zip(requests, reference.tokens, strict=True))
    assert same / total > 0.5, (same, total)
