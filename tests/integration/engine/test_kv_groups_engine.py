"""The scheduler's KV cache groups driving the real model runner: a Gemma-3-style model with
interleaved sliding/full layers (two groups) generates exactly transformers' greedy tokens for
prompts longer than the window, while the scheduler hands blocks that fell out of a window to
other requests, preempts under a small pool and serves prefix hits (the window group's hit
ends at the hit, with null blocks before it)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.scheduler.config import kv_cache_groups_from
from services.worker.loader import load_model
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import reference_greedy
from tests.support.tiny_models import make_tiny

BS = 4
MAX_TOKENS = 14


def test_interleaved_window_model_equals_transformers_with_window_blocks_reused(
    tmp_path: Path,
) -> None:
    reference = make_tiny(tmp_path, "gemma3")  # layers: sliding (window 8), full, sliding
    model, config = load_model(tmp_path, torch.float32, "cpu")
    assert [g.kind for g in config.kv_groups] == ["full", "sliding_window"]
    engine = InProcessEngine(
        tmp_path,
        num_blocks=40,  # too few for every request's two tables at once
        block_size=BS,
        max_num_batched_tokens=16,
        model_and_config=(model, config),
        scheduler_options={"kv_cache_groups": kv_cache_groups_from(config.kv_groups, BS)},
    )
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 500, (12,), generator=generator).tolist()
    prompts = {
        f"r{i}": (shared if i % 2 else [])
        + torch.randint(3, 500, (5 + 7 * i,), generator=generator).tolist()
        for i in range(5)
    }
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for rid, prompt in prompts.items():
        expected = reference_greedy(reference, prompt, MAX_TOKENS)
        assert out[rid].token_ids == expected[: len(out[rid].token_ids)], rid
        assert len(out[rid].token_ids) == MAX_TOKENS or out[rid].finish_reason == "stop"
    assert engine.scheduler.kv.stats.hits > 0
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_usable_blocks
