"""Prefill and mixed steps replayed from CUDA graphs (services/worker/accel/prefill_graphs.py):
the same tokens as eager steps, with chunked prefills beside decodes, and with steps overlapped
as the worker overlaps them (a decode's input token still on the device is fed into the
graph's static ids before the replay). Steps of at most 16 tokens: the GEMV then computes
every row alike at any padded size (fp32), so the tokens must be equal, not just close."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import make_tiny_llama

PROMPTS = {f"r{i}": [1, *[(37 * i + 11 * j) % 500 + 3 for j in range(5 + 9 * i)]] for i in range(6)}


def _run(path: Path, prefill_tokens: int, overlap: bool) -> tuple[dict[str, list[int]], int]:
    eng = InProcessEngine(
        path, device="cuda", num_blocks=96, block_size=16, max_num_batched_tokens=16,
        dtype=torch.float32,
    )  # fmt: skip
    eng.runner.warmup()
    eng.runner.capture_cuda_graphs(prefill_tokens=prefill_tokens)
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        params = (
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            if i % 2
            else SamplingParams(temperature=0.9, seed=i, max_tokens=12 + i, ignore_eos=True)
        )
        eng.submit(rid, prompt, params)
    out = eng.run(pipeline=overlap, overlap=overlap)
    graphs = eng.runner.prefill_graphs
    replays = sum(graphs.replays.values()) if graphs is not None else 0
    return {rid: g.token_ids for rid, g in out.items()}, replays


def test_prefill_graphs_give_the_eager_tokens(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    eager, none = _run(tmp_path, 0, overlap=False)
    assert none == 0
    graphed, replays = _run(tmp_path, 16, overlap=False)
    assert replays >= 5  # the prompt chunks and mixed steps (16 tokens a step at most)
    assert graphed == eager
    overlapped, replays = _run(tmp_path, 16, overlap=True)
    assert replays >= 5 and overlapped == eager
