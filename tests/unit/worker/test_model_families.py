"""Every supported family on tiny random weights: our runner's logits and greedy tokens equal
transformers' (fp32), alone and batched with chunked prefill, with prompts longer than the
sliding window where the family has one (window 8, blocks of 4: a decode reads 3 blocks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shared.model.config import ModelConfig
from shared.protocol import SamplingParams
from tests.support.grouped_plans import GroupedPlanDriver
from tests.support.tiny_llama import LogitsCapture, reference_greedy, reference_logits, tiny_runner
from tests.support.tiny_models import FAMILIES, make_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
LONG = [1, *range(40, 63)]  # 24 tokens: three windows of 8
PROMPTS = [LONG, [1, 400, 17], [1, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31], [9]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """family -> (dir, transformers model), built on first use."""
    return {}


def tiny(checkpoints: dict[str, tuple[Path, Any]], tmp: pytest.TempPathFactory, family: str):
    if family not in checkpoints:
        path = tmp.mktemp(family)
        checkpoints[family] = (path, make_tiny(path, family))
    return checkpoints[family]


def run_and_check(reference: Any, driver: GroupedPlanDriver, capture: LogitsCapture) -> None:
    """Run to the end; every sampled row's logits equal a full transformers forward at that
    position, and every output equals transformers' greedy generate."""
    driver.run()
    per_request: dict[str, list[torch.Tensor]] = {rid: [] for rid in driver.requests}
    sampling_steps = [r for r in driver.results if r.sampled]
    assert len(sampling_steps) == len(capture.calls)
    for result, logits in zip(sampling_steps, capture.calls, strict=True):
        for sampled, row in zip(result.sampled, logits, strict=True):
            per_request[sampled.request_id].append(row)
    for rid, request in driver.requests.items():
        full = reference_logits(reference, request.tokens)
        start = len(request.prompt) - 1
        ours = torch.stack(per_request[rid])
        torch.testing.assert_close(ours, full[start : start + len(ours)], rtol=1e-4, atol=1e-4)
        expected = reference_greedy(reference, request.prompt, GREEDY.max_tokens)
        assert request.output == expected, rid


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_alone_equals_transformers(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    path, reference = tiny(checkpoints, tmp_path_factory, family)
    runner = tiny_runner(path, num_blocks=48)
    capture = LogitsCapture(runner)
    driver = GroupedPlanDriver(runner)
    driver.add("long", LONG, GREEDY)
    run_and_check(reference, driver, capture)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_chunked_equals_transformers(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    path, reference = tiny(checkpoints, tmp_path_factory, family)
    runner = tiny_runner(path, num_blocks=48)
    capture = LogitsCapture(runner)
    driver = GroupedPlanDriver(runner, chunk_size=5, token_budget=12)
    driver.add("short", PROMPTS[3], GREEDY)
    driver.step()  # "short" decodes while the others arrive in chunks
    for i, prompt in enumerate(PROMPTS[:3]):
        driver.add(f"r{i}", prompt, GREEDY)
    run_and_check(reference, driver, capture)
    config = runner.config
    if any(w is not None for w in config.layer_windows):
        # Out-of-window blocks went back to the pool during the run (and were reused).
        full_blocks = -(-(len(LONG) + GREEDY.max_tokens) // runner.block_size)
        assert driver.peak_blocks["r0"] < full_blocks * len(runner.kv_groups)


def test_families_read_their_config_switches(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    configs = {
        f: ModelConfig.from_hf_dir(tiny(checkpoints, tmp_path_factory, f)[0]) for f in FAMILIES
    }
    assert configs["qwen2"].qkv_bias and configs["qwen2"].layer_windows == [None, 8, 8]
    assert configs["qwen3"].qk_norm and not configs["qwen3"].qkv_bias
    assert configs["mistral"].layer_windows == [8, 8, 8]
    gemma = configs["gemma3"]
    assert gemma.layer_windows == [8, None, 8] and gemma.rope_local is not None
    assert [g.kind for g in gemma.kv_groups] == ["full", "sliding_window"]
    assert configs["qwen2_moe"].moe_layers == [0, 2]  # mlp_only_layers=[1]
    assert configs["qwen2_moe"].shared_expert_intermediate_size == 40
    assert not configs["qwen2_moe"].norm_topk_prob and configs["mixtral"].norm_topk_prob
    assert configs["qwen3_moe"].num_experts == 6 and configs["qwen3_moe"].qk_norm
