"""After the worker's start-up on CUDA (runner warm-up, then CUDA graph capture, as
bootstrap.py runs them) serving compiles no Triton kernel: prefill chunks that continue a
cached prefix (paged prefill), prefix-cache hits, decode steps of odd and even sizes, eager
steps mixing decodes and prefills, sampled rows, top_p and logprobs (the fp32 copy), steps
overlapped as the worker overlaps them. Any compile after the warm-up held a serving step
(0.35-1.5 s each on the H200); the assertion names the kernels still compiled late.

The engine runs in a fresh (spawned) process: Triton keeps compiled kernels in memory, so in a
suite the earlier GPU tests would already hold what the warm-up compiles, the watch would see
no compile at all, and a kernel the warm-up misses could hide behind an earlier test's."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from meshllm_kernels.runtime.compile_watch import CompileWatch
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import make_tiny_llama


def _prompt(length: int, seed: int) -> list[int]:
    """`length` ids of the tiny model's 512-token vocabulary, past its specials."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


def _serve_after_warmup(model_dir: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """In this process: warm up, capture, serve; (kernels the warm-up compiled, (kernel,
    specialization) of every compile after it)."""
    eng = InProcessEngine(
        model_dir,
        device="cuda",
        dtype=torch.bfloat16,
        num_blocks=512,
        block_size=16,
        max_num_batched_tokens=40,  # long prompts in chunks: paged prefill, mixed steps
    )
    watch = CompileWatch().install()
    try:
        eng.runner.warmup()
        eng.runner.capture_cuda_graphs()
        torch.cuda.synchronize()
        watch.mark_warm()
        shared = _prompt(70, seed=1)
        params = [
            SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=6, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0.0, logprobs=2, max_tokens=5, ignore_eos=True),
        ]
        for wave, count in enumerate((1, 3, 2, 5, 17)):
            for i in range(count):
                prompt = shared + _prompt(5 + 7 * i, seed=100 * wave + i)
                eng.submit(f"w{wave}r{i}", prompt, params[(wave + i) % len(params)])
            out = eng.run(overlap=wave % 2 == 1)
            assert len(out) == count and all(g.finish_reason == "length" for g in out.values())
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    warm = [c.kernel for c in watch.compiles if not c.after_warmup]
    return warm, [(c.kernel, c.specialization) for c in watch.after_warmup()]


def test_serving_after_the_warmup_compiles_nothing(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    spawn = multiprocessing.get_context("spawn")  # a fresh Triton cache in memory (docstring)
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        warm, late = pool.submit(_serve_after_warmup, tmp_path).result(timeout=600)
    assert warm, "the warm-up compiled nothing: the watch saw no compile"
    assert late == [], late
