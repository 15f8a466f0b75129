"""MoE families decode in CUDA graphs: the fused-MoE kernel's expert alignment is sized on the
device (meshllm_kernels/layers/fused_moe.py: no host read), so the decode graphs capture the MoE
layers and replay them; greedy tokens equal transformers' (tiny random weights, fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.accel.cuda_graphs import DecodeGraphs
from services.worker.loader import load_model
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import reference_greedy
from tests.support.tiny_models import make_tiny

GREEDY = SamplingParams(max_tokens=10, temperature=0)
PROMPTS = {"a": [1, *range(40, 63)], "b": [1, 400, 17], "c": [9, 8, 7, 6, 5]}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_decode_replays_graphs_and_equals_transformers(tmp_path: Path, family: str) -> None:
    reference = make_tiny(tmp_path, family)
    engine = InProcessEngine(
        tmp_path, model_and_config=load_model(tmp_path, torch.float32, "cuda"), device="cuda"
    )
    engine.runner.warmup()
    engine.runner.capture_cuda_graphs()
    graphs = engine.runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    replays = 0
    run = graphs.run

    def counted(*args: Any) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return run(*args)

    graphs.run = counted  # type: ignore[method-assign]
    out = engine.generate(PROMPTS, GREEDY)
    assert replays > 0
    for rid, prompt in PROMPTS.items():
        assert out[rid].token_ids == reference_greedy(reference, prompt, GREEDY.max_tokens), rid
