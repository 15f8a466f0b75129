"""Routed experts from the runner: per computed position, each MoE layer's top-k expert ids
equal the router top-k of a transformers forward over the same tokens (output_router_logits);
Qwen-MoE and the hybrid GraniteMoeHybrid (its MoE layers include the mamba ones).

Contract (services/worker/runner/routed_experts.py): each SampledTokens carries the rows of the
positions computed for its request since the previous one, so rows of prompt chunks that
sampled nothing arrive with the first token, and concatenated they cover positions
0 .. len(tokens) - 2 (the last sampled token has not been computed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.protocol import SampledTokens, SamplingParams
from tests.support.grouped_plans import GroupedPlanDriver
from tests.support.tiny_llama import tiny_runner
from tests.support.tiny_models import make_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPT = [1, *range(100, 112)]  # 13 tokens: chunks of 5, 5, 3


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "granitemoehybrid"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp(request.param)
    return path, make_tiny(path, request.param)


def reference_routes(reference: Any, tokens: list[int]) -> np.ndarray:
    """[positions, moe_layers, top_k] from transformers' router logits."""
    with torch.no_grad():
        out = reference(torch.tensor([tokens]), output_router_logits=True)
    k = reference.config.num_experts_per_tok
    per_layer = [
        logits.view(len(tokens), -1).topk(k, dim=-1).indices for logits in out.router_logits
    ]
    return torch.stack(per_layer, dim=1).numpy()


def rows_of(sampled: list[SampledTokens]) -> np.ndarray:
    parts = []
    for s in sampled:
        assert s.routed_experts is not None and s.routed_experts_shape is not None
        parts.append(np.array(s.routed_experts).reshape(s.routed_experts_shape))
    return np.concatenate(parts)


def test_rows_equal_router_topk_through_chunks_and_decodes(moe: tuple[Path, Any]) -> None:
    path, reference = moe
    runner = tiny_runner(path)
    driver = GroupedPlanDriver(runner, chunk_size=5)
    driver.add("routed", PROMPT, GREEDY, routed_experts=True)
    driver.add("plain", [1, 7, 9], GREEDY)
    driver.run()
    sampled: dict[str, list[SampledTokens]] = {rid: [] for rid in driver.requests}
    for result in driver.results:
        for s in result.sampled:
            sampled[s.request_id].append(s)
    assert all(s.routed_experts is None for s in sampled["plain"])
    routed = sampled["routed"]
    num_moe = len(runner.config.moe_layers)
    first = routed[0].routed_experts_shape
    assert first == [len(PROMPT), num_moe, runner.config.num_experts_per_tok]
    assert all(s.routed_experts_shape == [1, *first[1:]] for s in routed[1:])
    tokens = driver.requests["routed"].tokens
    expected = reference_routes(reference, tokens)[: len(tokens) - 1]
    np.testing.assert_array_equal(rows_of(routed), expected)


def test_preempted_request_drops_its_pending_rows(moe: tuple[Path, Any]) -> None:
    path, reference = moe
    runner = tiny_runner(path)
    driver = GroupedPlanDriver(runner, chunk_size=5)
    driver.add("routed", PROMPT, GREEDY, routed_experts=True)
    driver.step()  # one chunk computed: its rows wait for a token
    driver.preempt("routed")
    driver.run()  # resumed from scratch: rows cover every position exactly once
    routed = [s for r in driver.results for s in r.sampled]
    tokens = driver.requests["routed"].tokens
    np.testing.assert_array_equal(
        rows_of(routed), reference_routes(reference, tokens)[: len(tokens) - 1]
    )
