"""Baseline: transformers `generate` decode throughput on the same model and machine.

Greedy, fixed output length (eos ignored via min_new_tokens), batch 1 and batch 8 aggregate;
the reference figures in ENVIRONMENT.md were taken the same way (SmolLM2-135M, 64 new tokens,
2 threads, fp32).

    python -m bench.baseline_transformers --batch 1 8 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def measure(model_dir: str, batch: int, input_len: int, output_len: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.randint(200, model.config.vocab_size, (batch, input_len))
    kwargs = dict(
        do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        elapsed = time.perf_counter() - t0
    new = (out.shape[1] - input_len) * batch
    return new / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", default="")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if not model_dir:
        from shared.config import ModelSettings
        from shared.model.source import resolve_model

        s = ModelSettings()
        model_dir = str(resolve_model(s.model, s.model_cache_dir).hf_dir)
    results = {
        f"batch_{b}": measure(model_dir, b, args.input_len, args.output_len, args.dtype)
        for b in args.batch
    }
    print(json.dumps({"engine": "transformers", "dtype": args.dtype, "output_tok_s": results}))


if __name__ == "__main__":
    main()
