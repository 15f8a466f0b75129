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
from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.grouped_plans import GroupedPlanDriver
from tests.support.tiny_llama import LogitsCapture

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=1234, max_tokens=5, logprobs=2, prompt_logprobs=2
)
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


def smollm2_greedy(
    tp: TensorParallel, hf_dir: str, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """SmolLM2 (9 q heads, 3 KV heads: split 3+6 / 1+2 over two ranks) in fp32: greedy outputs
    of the prompts batched, and the logits of the first sampled step."""
    model, config = load_model(Path(hf_dir), torch.float32, "cpu", max_model_len=256, tp=tp)
    kv = KVCache.allocate(config, 96, 16, torch.float32, "cpu")
    runner = ModelRunner(model, config, kv, "cpu", max_num_reqs=8, max_model_len=256)
    capture = LogitsCapture(runner)
    driver = GroupedPlanDriver(runner)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, greedy)
    driver.run()
    return {
        "outputs": [driver.requests[f"r{i}"].output for i in range(len(prompts))],
        "first_logits": capture.calls[0].numpy(),
        "heads": (config.num_attention_heads, config.num_key_value_heads),
    }


def ngram_greedy(
    tp: TensorParallel, hf_dir: str, prompts: dict[str, list[int]], max_tokens: int
) -> dict[str, Any]:
    """Greedy outputs through the scheduler core and this rank's runner (each rank schedules
    the same plans, as rank 0's plans reach the followers), without and with n-gram drafts;
    the drafts the scheduler saw verified, and the steps each run took."""
    model_and_config = load_model(Path(hf_dir), torch.float32, "cpu", max_model_len=4096, tp=tp)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)  # min_tokens: no drafts
    out: dict[str, Any] = {}
    ngram = SpeculativeConfig(method="ngram", num_spec_tokens=4)
    for name, spec in (("plain", None), ("ngram", ngram)):
        engine = InProcessEngine(
            hf_dir, model_and_config=model_and_config, speculative=spec, num_blocks=96
        )
        generated = engine.generate(prompts, greedy)
        stats = engine.scheduler.spec.stats
        out[name] = {
            "outputs": {rid: gen.token_ids for rid, gen in generated.items()},
            "drafted": stats.num_draft_tokens if spec else 0,
            "accepted": stats.num_accepted_tokens if spec else 0,
            "steps": engine.steps,
        }
    return out
