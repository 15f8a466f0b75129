"""Every model family on the CUDA worker (fp32, tiny random weights): greedy tokens equal the
CPU runner's and transformers', batched with chunked prefill — the MoE families through the
Triton fused-MoE kernel, the sliding-window families through their windowed attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.protocol import SamplingParams
from tests.support.grouped_plans import GroupedPlanDriver
from tests.support.tiny_llama import reference_greedy, tiny_runner
from tests.support.tiny_models import FAMILIES, make_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = [[1, *range(40, 63)], [1, 400, 17], [1, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31], [9]]


def _greedy(path: Path, device: str) -> dict[str, list[int]]:
    runner = tiny_runner(path, torch.float32, num_blocks=64, device=device)
    driver = GroupedPlanDriver(runner, chunk_size=5, token_budget=12)
    for i, prompt in enumerate(PROMPTS):
        driver.add(f"r{i}", prompt, GREEDY)
    driver.run()
    return {rid: list(request.output) for rid, request in driver.requests.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cuda_greedy_equals_cpu_and_transformers(tmp_path: Path, family: str) -> None:
    reference = make_tiny(tmp_path, family)
    gpu = _greedy(tmp_path, "cuda")
    assert gpu == _greedy(tmp_path, "cpu")
    for i, prompt in enumerate(PROMPTS):
        assert gpu[f"r{i}"] == reference_greedy(reference, prompt, GREEDY.max_tokens), family
