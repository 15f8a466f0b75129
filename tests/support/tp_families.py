"""What one rank of a tensor-parallel group computes for the tiny family checkpoints: greedy
tokens, the logits of every sampled row, seeded samples and routed experts, through the real
ModelRunner and a plan driver (batched, chunked prefill). Run on every rank by
tests/support/tp_ranks.py (and in-process at TP=1), so the tests compare TP=N with TP=1 and
with transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.worker.loader import load_model
from services.worker.parallel.group import TensorParallel
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from shared.protocol import SamplingParams
from tests.support.grouped_plans import GroupedPlanDriver
from tests.support.tiny_llama import LogitsCapture

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=5, logprobs=2)
PROMPTS = {
    "long": [1, *range(40, 60)],
    "short": [1, 400, 17],
    "one": [9],
}


def _runner(path: Path, tp: TensorParallel) -> ModelRunner:
    model, config = load_model(path, torch.float32, "cpu", tp=tp)
    kv = KVCache.allocate(config, 48, 4, torch.float32, "cpu")
    return ModelRunner(model, config, kv, "cpu", max_num_reqs=8)


def _drive(path: Path, tp: TensorParallel, sampling: SamplingParams) -> dict[str, Any]:
    runner = _runner(path, tp)
    capture = LogitsCapture(runner)
    driver = GroupedPlanDriver(runner, chunk_size=5, token_budget=12)
    moe = runner.config.num_moe_layers > 0
    for rid, prompt in PROMPTS.items():
        driver.add(rid, prompt, sampling, routed_experts=moe)
    driver.run()
    sampled = [s.model_dump(exclude={"draft_token_ids"}) for r in driver.results for s in r.sampled]
    return {
        "outputs": {rid: req.output for rid, req in driver.requests.items()},
        "logits": [t.numpy() for t in capture.calls],  # numpy: crosses the rank queue as bytes
        "sampled": sampled,
        "kv_heads": runner.config.num_key_value_heads,
    }


def family_runs(tp: TensorParallel, checkpoints: dict[str, str]) -> dict[str, dict[str, Any]]:
    """family -> {"greedy": run, "seeded": run} for every checkpoint dir."""
    return {
        family: {
            "greedy": _drive(Path(path), tp, GREEDY),
            "seeded": _drive(Path(path), tp, SEEDED),
        }
        for family, path in checkpoints.items()
    }
