"""Decode step time of the worker's ModelRunner alone (no bus), SmolLM2-135M.

For each dtype and batch size: one prefill step of `--prompt-len` tokens per request, then
`--steps` decode steps. Reports the median decode step, tokens/s, and where the step goes:
model forward (30 layers), logits + sampling, and the host overhead outside both (plan diff,
index building, result objects).

    .venv/bin/python -m bench.worker_step --threads 2
    python -m bench.worker_step --device cuda --random llama3-8b --batch 1 8 64 --dtype bfloat16

`--random` builds the named shape with random weights (speed does not depend on the values).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from services.worker.loader import load_model, prepare_for_device
from services.worker.models.registry import build_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from shared.model.config import ModelConfig, RopeScaling
from shared.model.source import resolve_model
from shared.protocol import SamplingParams
from tests.support.plans import PlanDriver

RANDOM_SHAPES = {
    "smollm2": ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope=RopeScaling(theta=100000.0),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=[2],
    ),
    "llama3-8b": ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope=RopeScaling(
            rope_type="llama3",
            theta=500000.0,
            factor=8.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
    ),
}


class Timer:
    """Accumulates wall time of one callable (instrumentation for the breakdown only)."""

    def __init__(self, fn: Callable[..., Any], sync: bool) -> None:
        self.fn = fn
        self.sync = sync
        self.total = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.total += time.perf_counter() - started


def random_model(
    name: str, dtype: torch.dtype, device: str, plain_weights: bool
) -> tuple[Any, ModelConfig]:
    config = RANDOM_SHAPES[name]
    with torch.device(device):
        model = build_model(config, max_model_len=1024).to(dtype)
        for param in model.parameters():
            param.data.normal_(0.0, 0.02)
    model.rotary.materialize(device, dtype)
    if not plain_weights:
        prepare_for_device(model, dtype, torch.device(device))
    return model.eval().requires_grad_(False), config


def bench(
    model_dir: str,
    random: str,
    device: str,
    dtype: torch.dtype,
    batch: int,
    prompt_len: int,
    steps: int,
    plain_weights: bool = False,
    profile: bool = False,
    compiled: bool = False,
    cpu_attention: str = "auto",
    trace: str = "",
) -> dict:
    if random:
        model, config = random_model(random, dtype, device, plain_weights or compiled)
    else:
        model, config = load_model(model_dir, dtype, device, compiled=compiled)
    blocks = batch * (-(-(prompt_len + steps + 12) // 16)) + 8
    kv = KVCache.allocate(config, num_blocks=blocks, block_size=16, dtype=dtype, device=device)
    runner = ModelRunner(
        model,
        config,
        kv,
        device,
        max_num_reqs=max(batch, 8),
        max_model_len=1024,
        compiled=compiled,
        cpu_attention=cpu_attention,  # type: ignore[arg-type]
    )
    warmup_s = runner.warmup()
    # A decode step reads every weight once, except the embedding (a few rows) when the head
    # has its own matrix (untied, or a packed copy of a tied one).
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if "packed" in n)]
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if model.lm_head is not None:
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    sync = torch.device(device).type == "cuda"
    forward = Timer(runner.model_forward, sync)
    logits = Timer(runner.compute_logits, sync)
    sample = Timer(runner.sampler.sample, sync)
    runner.model_forward, runner.compute_logits = forward, logits  # type: ignore[method-assign]
    runner.sampler.sample = sample  # type: ignore[method-assign]
    driver = PlanDriver(runner, token_budget=batch * prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 12, ignore_eos=True)
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
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU]
        if sync:  # CUDA: where the device time of a step goes, kernel by kernel
            activities.append(ProfilerActivity.CUDA)
        with torch_profile(activities=activities) as prof:
            for _ in range(10):
                driver.step()
        order = "self_cuda_time_total" if sync else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=order, row_limit=18))
        if trace:
            from services.worker.runner.kernel_trace import summarize_trace

            prof.export_chrome_trace(trace)
            print(summarize_trace(trace, steps=10))
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
        "best_tok_s": batch / min(row[1] for row in rows),
        "gb_s": weight_bytes / execute / 1e9,
        "warmup_s": warmup_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="", help="HF dir or .gguf (default: embedded SmolLM2)")
    parser.add_argument("--random", default="", choices=["", *RANDOM_SHAPES])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--plain-weights",
        action="store_true",
        help="with --random: skip the CPU weight layouts (column-major fp32, packed bf16)",
    )
    parser.add_argument("--profile", action="store_true", help="print a torch profile table")
    parser.add_argument(
        "--trace",
        default="",
        help="with --profile: write the chrome trace here and print each kernel's time and the "
        "gaps between kernels (services/worker/runner/kernel_trace.py)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="compile the forward (CPU bf16; cpu_compile.py)"
    )
    parser.add_argument(
        "--cpu-attention",
        default="auto",
        choices=["auto", "kernel", "torch"],
        help="decode attention on CPU: the C++ kernel (auto/kernel) or PyTorch",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = "" if args.random else str(resolve_model(args.model, "~/.cache/meshllm").path)
    name = args.random or "SmolLM2"
    header = (
        f"{'dtype':<9} {'batch':>5} {'step ms':>8} {'tok/s':>7} {'forward':>8} "
        f"{'logits+sample':>13} {'overhead':>8} {'GB/s':>6} {'best tok/s':>10}"
    )
    print(
        f"{name} ModelRunner decode on {args.device}, {args.threads} threads, "
        f"prompt {args.prompt_len}, {args.steps} steps (median ms per step; GB/s = weight "
        "bytes read per step / step time; best = fastest step, the least disturbed by other load)"
    )
    print(header)
    for dtype_name in args.dtype:
        for batch in args.batch:
            dtype = getattr(torch, dtype_name)
            r = bench(
                model_dir,
                args.random,
                args.device,
                dtype,
                batch,
                args.prompt_len,
                args.steps,
                args.plain_weights,
                args.profile,
                args.compile,
                args.cpu_attention,
                args.trace,
            )
            print(
                f"{r['dtype']:<9} {r['batch']:>5} {r['step_ms']:>8.2f} {r['tok_s']:>7.1f} "
                f"{r['forward_ms']:>8.2f} {r['logits_sample_ms']:>13.2f} {r['overhead_ms']:>8.2f} "
                f"{r['gb_s']:>6.1f} {r['best_tok_s']:>10.1f}   (warm-up {r['warmup_s']:.1f} s)"
            )


if __name__ == "__main__":
    main()
