"""Baseline: transformers `generate` decode throughput, warmed and best-of-N.

Greedy, every sequence exactly `--output-len` new tokens (min_new_tokens; eos cannot end it
early), random prompt token ids of `--input-len`. Tokens/s = new tokens of the batch over the
wall time of the whole `generate` call (prefill included; CUDA synchronized), the same
accounting as the serving benchmarks' output throughput. Before timing, one untimed `generate`
of the same shape: a cold first call is 2-3x slower on the H200 (allocator, kernel selection),
and a baseline timed cold against a warm engine is not a result. Then `--repeats` timed calls,
each on fresh prompts; reported: best and median.

    python -m bench.baseline_transformers --batch 1 8 --output-len 64            # CPU, SmolLM2
    python3 -m bench.baseline_transformers --model random:llama-3-8b --device cuda \
        --dtype bfloat16 --batch 64 256 --input-len 512 --output-len 128         # GPU

`--model`: an HF directory, a .gguf, empty for MESHLLM_MODEL (the embedded SmolLM2-135M-Instruct
when that is empty too), or
`random:<preset>` (services/worker/models/random_init.py: real shapes, random weights, built
on the device; speed does not depend on the values).

`--static-compile`: transformers' fastest documented mode, a static KV cache
(`cache_implementation="static"`), with which `generate` compiles the decoding forward itself
(its `compile_config`: torch.compile with CUDA graphs; on CUDA only); the untimed warm-up of
each shape then also compiles it. Wrapping the forward in torch.compile by hand instead breaks
on the static cache's in-place updates under CUDA graphs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

FIRST_PLAIN_TOKEN = 200  # below: special tokens in most vocabularies (as bench/serve.py)


class TransformersDecode:
    """One model loaded once; `tok_s(prompts, output_len)` times a `generate` over them."""

    def __init__(self, model: str, dtype: str, device: str, static_compile: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        torch_dtype = getattr(torch, dtype)
        if model.startswith("random:"):
            from transformers import AutoConfig

            from services.worker.models.random_init import random_hf_config

            cfg = {
                k: v
                for k, v in random_hf_config(model).items()
                if k not in ("architectures", "torch_dtype")
            }
            config = AutoConfig.for_model(**cfg)
            torch.manual_seed(0)
            with self.device:
                built = AutoModelForCausalLM.from_config(config)
            self.model = built.to(torch_dtype).eval()
        else:
            from shared.config import ModelSettings
            from shared.model.source import resolve_model

            hf_dir = resolve_model(model, ModelSettings().model_cache_dir).hf_dir
            self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype)
            self.model = self.model.to(self.device).eval()
        self.vocab = int(self.model.config.vocab_size)
        self.static_compile = static_compile

    def prompts(self, n: int, input_len: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [
            [rng.randrange(FIRST_PLAIN_TOKEN, self.vocab) for _ in range(input_len)]
            for _ in range(n)
        ]

    def tok_s(self, prompts: list[list[int]], output_len: int) -> float:
        """New tokens per second of one `generate` over `prompts` (all of one length)."""
        ids = torch.tensor(prompts, device=self.device)
        kwargs: dict[str, Any] = dict(
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
        if self.static_compile:
            kwargs["cache_implementation"] = "static"
        with torch.inference_mode():
            self._sync()
            started = time.perf_counter()
            out = self.model.generate(ids, **kwargs)
            self._sync()
            elapsed = time.perf_counter() - started
        return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def measure(
    engine: TransformersDecode, batch: int, input_len: int, output_len: int, repeats: int
) -> dict[str, Any]:
    engine.tok_s(engine.prompts(batch, input_len, seed=-1), output_len)  # warm-up, same shape
    runs = [
        engine.tok_s(engine.prompts(batch, input_len, seed=i), output_len) for i in range(repeats)
    ]
    return {
        "batch": batch,
        "input_len": input_len,
        "output_len": output_len,
        "tok_s_runs": [round(r, 1) for r in runs],
        "best_tok_s": round(max(runs), 1),
        "median_tok_s": round(statistics.median(runs), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="HF dir, .gguf, random:<preset>; default SmolLM2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per batch (best-of-N)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = default")
    p.add_argument("--out", default="", help="also write the JSON result here")
    p.add_argument(
        "--static-compile", action="store_true", help="static KV cache + torch.compile (see above)"
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.model:
        from shared.config import ModelSettings

        args.model = ModelSettings().model
    engine = TransformersDecode(args.model, args.dtype, args.device, args.static_compile)
    rows = []
    for batch in args.batch:
        rows.append(measure(engine, batch, args.input_len, args.output_len, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "engine": "transformers generate"
        + (", static cache + compile" if args.static_compile else ""),
        "model": args.model or "SmolLM2-135M-Instruct",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "runs": rows,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
