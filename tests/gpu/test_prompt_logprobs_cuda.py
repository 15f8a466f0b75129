"""Prompt logprobs on CUDA (the worker's LM head over prompt positions, between the forward
and the sampling, with CUDA graphs captured and steps launched ahead): a tiny fp32 Llama's
equal transformers' log-softmax, under chunked prefill, with decodes of other requests in the
same steps."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.tiny_llama import make_tiny_llama

PROMPTS = {
    "a": [1, 17, 40, 3, 99, 250, 7, 8, 9, 10, 11, 12, 13],
    "b": [1, 5],
    "c": [1, *range(300, 340)],
}
K = 2


def test_prompt_logprobs_on_cuda_equal_transformers(tmp_path: Path) -> None:
    hf = make_tiny_llama(tmp_path)
    eng = InProcessEngine(tmp_path, device="cuda", max_num_batched_tokens=12)
    eng.runner.warmup()
    eng.runner.capture_cuda_graphs()
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=K, prompt_logprobs=K)
    eng.submit("plain", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=30))
    got = eng.generate(PROMPTS, params, pipeline=True, overlap=True, ahead=3)
    with torch.inference_mode():
        for rid, ids in PROMPTS.items():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            values = got[rid].prompt_logprobs
            assert values is not None and len(values) == len(ids) - 1, rid
            expected = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(values), expected, atol=1e-3), rid
            top = torch.tensor(got[rid].prompt_top_logprobs).view(-1, K)
            assert torch.allclose(top, ref.topk(K, dim=-1).values, atol=1e-3), rid
