"""Overlapped steps on the GPU (services/worker/runner/in_flight.py): step N+1 launched while step N
still runs, its input ids for N's tokens gathered on the device from N's samples, N's tokens
copied to the host asynchronously. The tokens must equal a step-by-step run's, with CUDA
graphs (decode-only steps) and eager steps (chunked prefill mixed in) both overlapped."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import make_tiny_llama

PROMPTS = {f"r{i}": [1, *[(37 * i + 11 * j) % 500 + 3 for j in range(5 + 9 * i)]] for i in range(6)}


def _run(path: Path, overlap: bool) -> tuple[dict[str, tuple[list[int], str | None]], int]:
    eng = InProcessEngine(
        path,
        device="cuda",
        num_blocks=96,
        block_size=16,
        max_num_batched_tokens=24,  # chunked prefill: mixed eager steps
        dtype=torch.float32,
    )
    eng.runner.capture_cuda_graphs()
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        params = (
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            if i % 2
            else SamplingParams(temperature=0.9, seed=i, max_tokens=10 + 3 * i, ignore_eos=True)
        )
        eng.submit(rid, prompt, params)
    out = eng.run(pipeline=True, overlap=overlap)
    assert not eng.scheduler.has_work()
    assert 0 < eng.runner.last_device_seconds < 1  # the last step's device time, timed
    return {rid: (g.token_ids, g.finish_reason) for rid, g in out.items()}, eng.launched_ahead


def test_overlapped_steps_equal_step_by_step_on_cuda(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    planned, _ = _run(tmp_path, overlap=False)
    launched, launched_ahead = _run(tmp_path, overlap=True)
    assert launched_ahead > 20  # really launched ahead, most of the way
    assert launched == planned
    assert all(reason == "length" for _, reason in launched.values())
