"""The computed bound of a batch run on this card: the fastest a run of `batch` prompts of
`prompt` tokens, each decoding `output` tokens, could go on a dense decoder, from two rates
measured on the card in the same call (#36's bound, each step at the better of its two limits):

- prefill: every prompt token's linear-layer FLOPs plus its causal attention, at the card's
  measured dense bf16 GEMM rate (8192 x 8192 x 8192);
- each decode step after the first token: the larger of its bytes (every weight a step reads,
  the LM head's included, plus the K/V of every sequence's context so far) at the measured HBM
  read rate, and its FLOPs (2 per weight per row) at the GEMM rate.

tok/s bound = batch * output / (prefill seconds + the decode steps' seconds). A kernel chain
that runs the step's GEMMs and its attention one after the other cannot reach it where both
are large (batch 256): the bound is what overlapping them would give, as the issue defines it.

    python3 -m bench.gpu.run_bound --batch 64 256        # rates of this card, then the bounds
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import asdict, dataclass

from services.worker.models.random_init import random_hf_config
from shared.model.config import ModelConfig


@dataclass(frozen=True)
class Rates:
    """What the card did in this call: HBM read TB/s and dense bf16 GEMM TFLOP/s."""

    read_tbs: float
    gemm_tflops: float


@dataclass(frozen=True)
class ModelCosts:
    """Per-token costs of a dense decoder in its serving dtype."""

    layer_params: int  # the decoder layers' linear weights
    head_params: int  # the LM head's
    kv_bytes_per_token: int  # K and V of one token over every layer
    attention_dim: int  # query heads x head_dim
    num_layers: int
    dtype_bytes: int = 2

    @classmethod
    def of(cls, config: ModelConfig, dtype_bytes: int = 2) -> ModelCosts:
        if config.num_experts or config.layer_types:
            raise ValueError("the run bound models dense full-attention decoders only")
        h, hd, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
        q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
        return cls(
            layer_params=per_layer * layers,
            head_params=config.vocab_size * h,
            kv_bytes_per_token=2 * layers * kv * dtype_bytes,
            attention_dim=q,
            num_layers=layers,
            dtype_bytes=dtype_bytes,
        )


def run_bound(costs: ModelCosts, rates: Rates, batch: int, prompt: int, output: int) -> dict:
    """Seconds of each phase and the bound on output tok/s (module docstring)."""
    gemm = rates.gemm_tflops * 1e12
    read = rates.read_tbs * 1e12
    # causal attention of one prompt: QK^T and PV over L^2 / 2 pairs, 2 FLOPs a multiply-add
    attention = 2 * 2 * (prompt * prompt / 2) * costs.attention_dim * costs.num_layers
    prefill_flops = batch * (prompt * 2 * costs.layer_params + attention)
    prefill_flops += batch * 2 * costs.head_params  # the first token's logits
    prefill_s = prefill_flops / gemm
    weight_bytes = (costs.layer_params + costs.head_params) * costs.dtype_bytes
    step_flops = batch * 2 * (costs.layer_params + costs.head_params)
    decode_s = 0.0
    memory_bound_steps = 0
    for i in range(1, output):
        kv_bytes = batch * (prompt + i) * costs.kv_bytes_per_token
        memory_s = (weight_bytes + kv_bytes) / read
        decode_s += max(memory_s, step_flops / gemm)
        memory_bound_steps += memory_s >= step_flops / gemm
    total = prefill_s + decode_s
    return {
        "batch": batch,
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "decode_steps_memory_bound": memory_bound_steps,
        "bound_tok_s": round(batch * output / total, 1),
    }


def measure_rates(rounds: int = 3) -> Rates:
    """HBM read rate (a sum over 2 GiB) and bf16 GEMM rate (8192^3) on CUDA device 0: each the
    median of graph_timing.median_ms (the timer of kernel_timings' HBM ceilings), the best of
    `rounds` rounds. The best, not the mean: the same H100 gave 680 and 714 TFLOP/s in two
    measurements minutes apart (clocks under its power limit), and the bound is the fastest the
    card went."""
    import torch

    from bench.gpu.graph_timing import median_ms

    src = torch.randn(1 << 29, device="cuda")  # 2 GiB of fp32
    read_ms = min(median_ms(src.sum) for _ in range(rounds))
    del src
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = min(median_ms(functools.partial(torch.matmul, a, b)) for _ in range(rounds))
    del a, b
    torch.cuda.empty_cache()
    return Rates(
        read_tbs=round((1 << 31) / read_ms / 1e9, 3),
        gemm_tflops=round(2 * n**3 / gemm_ms / 1e9, 1),
    )


def bounds(model: str, batches: list[int], prompt: int, output: int, rates: Rates) -> dict:
    """The rates and each batch's bound, for the `random:` model spec (mesh_decode's)."""
    costs = ModelCosts.of(ModelConfig.from_hf_dict(random_hf_config(model)))
    return {
        "rates": asdict(rates),
        "per_batch": {str(b): run_bound(costs, rates, b, prompt, output) for b in batches},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    args = parser.parse_args()
    print(json.dumps(bounds(args.model, args.batch, args.prompt, args.output, measure_rates())))


if __name__ == "__main__":
    main()
