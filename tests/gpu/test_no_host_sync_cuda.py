"""Launching a step never waits for the GPU (issue #9: no host synchronisation on the hot path
except the one copy of sampled tokens, which `finish` waits for).

A launch that synchronizes (a pageable upload with `non_blocking=False`, `.item()`, `.tolist()`
or `nonzero()` on a device tensor) blocks the host until the step before it has finished on the
device, so the next step's inputs are staged and its kernels launched on an idle GPU. Each
`ModelRunner.launch` here runs under `torch.cuda.set_sync_debug_mode("warn")`, which warns at
every synchronizing call; the test lists where they came from. The run mixes what the mesh
meets: requests arriving in chunked prefill while others decode (eager steps and CUDA graphs,
launched one ahead as the worker service launches them) and every sampling feature that keeps
per-request state on the device."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.host_sync import guarded
from tests.support.tiny_llama import make_tiny_llama

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, top_p=0.9, top_k=20, max_tokens=12, ignore_eos=True),
    SamplingParams(
        temperature=0.7,
        seed=4,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        max_tokens=12,
        ignore_eos=True,
    ),
    SamplingParams(
        temperature=0.0, logit_bias={5: 2.0, 7: -100.0}, bad_token_ids=[9, 10], max_tokens=12
    ),
    SamplingParams(
        temperature=0.9, seed=5, allowed_token_ids=list(range(3, 200)), min_p=0.05, max_tokens=12
    ),
    SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=[11], max_tokens=12),
    SamplingParams(temperature=0.6, seed=6, logprobs=3, max_tokens=12, ignore_eos=True),
    SamplingParams(
        temperature=0.5,
        seed=7,
        bad_words_token_ids=[[9], [20, 21], [30, 31, 32]],
        max_tokens=12,
        ignore_eos=True,
    ),
]


def test_launching_a_step_never_synchronizes(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    eng = InProcessEngine(
        tmp_path,
        device="cuda",
        num_blocks=128,
        block_size=16,
        max_num_batched_tokens=40,  # chunked prefill: later prompts arrive while others decode
        dtype=torch.bfloat16,
    )
    # As the worker starts (services/worker/runner/bootstrap.py): first-call probes.
    eng.runner.warmup()
    eng.runner.capture_cuda_graphs()
    sites: list[str] = []
    eng.runner.launch = guarded(eng.runner.launch, sites)  # type: ignore[method-assign]
    for i, params in enumerate(PARAMS * 2):
        prompt = [1, *[(29 * i + 7 * j) % 400 + 12 for j in range(8 + 5 * i)]]
        eng.submit(f"r{i}", prompt, params)
    out = eng.run(overlap=True, ahead=3)
    assert len(out) == 2 * len(PARAMS)
    assert all(g.finish_reason is not None for g in out.values())
    assert eng.launched_ahead > 10  # steps really were launched behind unfinished ones
    # The guard itself sees a synchronizing call (so an empty list means something).
    probe: list[str] = []
    guarded(lambda plan: torch.ones(2, device="cuda").nonzero(), probe)(None)  # type: ignore[arg-type]
    assert probe, "set_sync_debug_mode reported nothing for nonzero()"
    assert not sites, f"launch() synchronized with the GPU at: {sorted(set(sites))}"
