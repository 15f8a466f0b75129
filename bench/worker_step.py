"""Decode step time of the worker's ModelRunner alone (no bus), SmolLM2-135M.

For each dtype and batch size: one prefill step of `--prompt-len` tokens per request, then
`--steps` decode steps. Reports the median decode step, tokens/s, and where the step goes:
model forward (30 layers), logits + sampling, and the host overhead outside both (plan diff,
index building, result objects).

    .venv/bin/python -m bench.worker_step --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from services.worker.kv_cache import KVCache
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from shared.model_source import resolve_model
from shared.protocol import SamplingParams
from tests.support.plans import PlanDriver


class Timer:
    """Accumulates wall time of one callable (instrumentation for the breakdown only)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.total = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - started


def bench(model_dir: str, dtype: torch.dtype, batch: int, prompt_len: int, steps: int) -> dict:
    model, config = load_model(model_dir, dtype)
    kv = KVCache.allocate(
        config, num_blocks=batch * 16 + 8, block_size=16, dtype=dtype, device="cpu"
    )
    runner = ModelRunner(model, config, kv, max_model_len=1024)
    runner.warmup()
    forward = Timer(model.forward)
    logits = Timer(model.compute_logits)
    sample = Timer(runner.sampler.sample)
    model.forward, model.compute_logits = forward, logits  # type: ignore[method-assign]
    runner.sampler.sample = sample  # type: ignore[method-assign]
    driver = PlanDriver(runner)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        prompt = [(17 * i + 31 * j) % config.vocab_size for j in range(prompt_len)]
        driver.add(f"req-{i}", prompt, params)
    driver.step()  # prefill (samples the first token)
    rows = []
    for _ in range(steps):
        forward.total = logits.total = sample.total = 0.0
        started = time.perf_counter()
        result = driver.step()
        wall = time.perf_counter() - started
        assert len(result.sampled) == batch
        rows.append((wall, result.execute_ms / 1000, forward.total, logits.total + sample.total))
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    wall, execute, fwd, head = med
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "step_ms": execute * 1000,
        "tok_s": batch / execute,
        "forward_ms": fwd * 1000,
        "logits_sample_ms": head * 1000,
        "overhead_ms": (execute - fwd - head) * 1000,
        "driver_ms": (wall - execute) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="", help="HF dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model, "~/.cache/meshllm").path)
    header = (
        f"{'dtype':<9} {'batch':>5} {'step ms':>8} {'tok/s':>7} {'forward':>8} "
        f"{'logits+sample':>13} {'overhead':>8}"
    )
    print(
        f"SmolLM2 ModelRunner decode, {args.threads} threads, prompt {args.prompt_len}, "
        f"{args.steps} steps (median ms per step)"
    )
    print(header)
    for dtype_name in args.dtype:
        for batch in args.batch:
            r = bench(model_dir, getattr(torch, dtype_name), batch, args.prompt_len, args.steps)
            print(
                f"{r['dtype']:<9} {r['batch']:>5} {r['step_ms']:>8.2f} {r['tok_s']:>7.1f} "
                f"{r['forward_ms']:>8.2f} {r['logits_sample_ms']:>13.2f} {r['overhead_ms']:>8.2f}"
            )


if __name__ == "__main__":
    main()
