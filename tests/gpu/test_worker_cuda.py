"""The worker on CUDA against references: greedy tokens of a tiny fp32 Llama equal the CPU
runner's and transformers'; bf16 logits of an 8B-shaped Llama match transformers' forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.attention.select import build_attention_metadata
from services.worker.loader.checkpoint_names import assemble
from services.worker.models.layer_impls import REFERENCE
from services.worker.models.random_init import PRESETS, build_random_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from shared.protocol import SamplingParams
from tests.support.hf_rope import restore_fp32_inv_freq
from tests.support.plans import PlanDriver
from tests.support.tiny_llama import LogitsCapture, make_tiny_llama, reference_greedy, tiny_runner

PROMPTS = [[1, 17, 40, 3, 99, 250, 7], [1, 5], [1, 300, 301, 302, 303, 304, 305, 306, 307, 1, 2]]


def _greedy(runner: ModelRunner, max_tokens: int) -> dict[str, list[int]]:
    driver = PlanDriver(runner, token_budget=12, chunk_size=5)  # chunked prefill + decodes
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        driver.add(f"r{i}", prompt, params)
    return driver.run()


def test_gpu_greedy_equals_cpu_reference_tiny_fp32(tmp_path: Path) -> None:
    hf = make_tiny_llama(tmp_path)
    cpu = _greedy(tiny_runner(tmp_path, torch.float32, max_num_reqs=4), 24)
    gpu_runner = tiny_runner(tmp_path, torch.float32, max_num_reqs=4, device="cuda")
    gpu_runner.warmup()
    gpu_runner.capture_cuda_graphs()
    assert gpu_runner.graphs is not None and gpu_runner.graphs.sizes == (1, 2, 4)
    gpu = _greedy(gpu_runner, 24)
    assert gpu == cpu
    for i, prompt in enumerate(PROMPTS):
        assert gpu[f"r{i}"] == reference_greedy(hf, prompt, 24)


def _hf_8b(layers: int) -> tuple[LlamaForCausalLM, dict]:
    cfg = dict(PRESETS["llama-3-8b"], num_hidden_layers=layers)
    cfg.pop("architectures")
    cfg.pop("torch_dtype")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    restore_fp32_inv_freq(model)  # the cast rounds transformers' RoPE frequencies to bf16
    return model, cfg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.timeout(600)
def test_8b_bf16_cuda_path_matches_pytorch_reference_forward() -> None:
    """The worker's CUDA path (Triton kernels, CUDA graphs) against the same bf16 weights run
    through the PyTorch reference path (services/worker/attention/reference.py, torch layers) on the
    GPU: every sampled position's logits within bf16 tolerance, greedy choices equal unless
    near-tied. The error against transformers' bf16 forward of the same weights (RoPE
    frequencies restored to fp32) is printed too: 0.058-0.075 on the H200, as against our
    reference path (docs/decode-on-h200.md)."""
    from services.worker.attention.reference import AttentionMetadata

    hf, cfg = _hf_8b(layers=32)
    cfg = dict(cfg, architectures=["LlamaForCausalLM"])
    ours, config = build_random_model(cfg, torch.bfloat16, "cuda", 1024)  # the Triton layers
    state = assemble(hf.state_dict().items(), torch.bfloat16, torch.device("cuda"), False)
    ours.load_state_dict(state, strict=True)
    reference, _ = build_random_model(cfg, torch.bfloat16, "cuda", 1024, impls=REFERENCE)
    reference.load_state_dict(state, strict=True)
    del state
    kv = KVCache.allocate(config, 256, 16, torch.bfloat16, "cuda")
    runner = ModelRunner(ours, config, kv, "cuda", max_num_reqs=4, max_model_len=1024)
    runner.warmup()
    runner.capture_cuda_graphs()
    capture = LogitsCapture(runner)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128256, (n,), generator=gen).tolist() for n in (300, 37)]
    driver = PlanDriver(runner, token_budget=512)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, params)
    outputs = driver.run()
    step_logits = capture.calls  # prefill step (eager), then 3 decode steps (graph)
    assert len(step_logits) == 4
    errors, hf_errors, flips = [], [], []
    for i, prompt in enumerate(prompts):
        seq = prompt + outputs[f"r{i}"]
        n = len(seq)
        ref_kv = KVCache.allocate(config, 32, 16, torch.bfloat16, "cuda")
        meta = AttentionMetadata.build(
            query_lens=np.array([n]), seq_lens=np.array([n]),
            block_tables=np.arange(-(-n // 16))[None], block_size=16,
            slot_mapping=np.arange(n), device="cuda",
        )  # fmt: skip
        with torch.inference_mode():
            ids = torch.tensor(seq, device="cuda")
            hidden = reference(ids, torch.arange(n, device="cuda"), meta, ref_kv.layers)
            ref = reference.compute_logits(hidden)
            hf_logits = hf(ids[None]).logits[0]
        for step, logits in enumerate(step_logits):
            pos = len(prompt) - 1 + step
            errors.append(_rel(logits[i], ref[pos]))
            hf_errors.append(_rel(logits[i], hf_logits[pos]))
            top2 = ref[pos].float().topk(2).values
            clear = float(top2[0] - top2[1]) > 0.05 * float(top2[0].abs())
            if clear and int(logits[i].argmax()) != int(ref[pos].argmax()):
                flips.append((i, step))
    print("8B bf16 rel. logits error, CUDA path vs PyTorch path:", [round(e, 4) for e in errors])
    print("8B bf16 rel. logits error, CUDA path vs transformers:", [round(e, 4) for e in hf_errors])
    assert not flips, f"greedy choice differs at (request, step) {flips}"
    # bf16 tolerance at this depth: transformers' own bf16 forward of such a model departs from
    # its fp32 forward by 5-8% on the H200 (docs/decode-on-h200.md), random weights
    # amplifying rounding through 32 layers.
    assert max(errors) < 0.1, errors


def test_8b_shape_fp32_cuda_path_matches_transformers() -> None:
    """2 layers of the Llama-3-8B shape (theta 5e5, head_dim 128) in fp32, 300-token prompt:
    the worker's CUDA path equals transformers' forward on the same weights (the 0.115 gap
    once seen here came from transformers' bf16-rounded RoPE frequencies, tests/support/hf_rope)."""
    hf, cfg = _hf_8b(layers=2)
    hf = hf.float()
    restore_fp32_inv_freq(hf)
    cfg = dict(cfg, architectures=["LlamaForCausalLM"])
    ours, config = build_random_model(cfg, torch.float32, "cuda", 1024)  # the Triton layers
    ours.load_state_dict(
        assemble(hf.state_dict().items(), torch.float32, torch.device("cuda"), False)
    )
    n = 300
    kv = KVCache.allocate(config, 32, 16, torch.float32, "cuda")
    meta = build_attention_metadata(
        query_lens=np.array([n]), seq_lens=np.array([n]), block_tables=np.arange(19)[None],
        block_size=16, slot_mapping=np.arange(n), num_kv_heads=8, device="cuda",
        backend=TritonPagedAttention(),
    )  # fmt: skip
    ids = torch.randint(0, 128256, (n,), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.inference_mode():
        logits = ours.compute_logits(ours(ids, torch.arange(n, device="cuda"), meta, kv.layers))
        ref = hf(ids[None]).logits[0]
    err = _rel(logits[-1], ref[-1])
    print("8B shape, 2 layers, fp32: rel. logits error vs transformers", err)
    assert err < 1e-3
