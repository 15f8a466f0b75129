"""One eager prefill step of the worker's model on a GPU: dense flash attention for fresh spans
against the paged Triton kernel, next to the step's GEMM bound (Llama-3-8B shape, bf16).

    python3 -m bench.gpu.prefill_step --out $OUT/prefill_step.json      # on the H200
    .venv/bin/python -m bench.gpu.prefill_step --dry-run                # CPU, tiny shapes

The step is `--spans` fresh prompts of `--prompt` tokens (16 x 512 = 8192 tokens: one step of the
decode benchmark's chunked prefill). Reported (CUDA events, median): the whole forward with
dense prefill, the same with every span on the paged kernel, every linear of the step alone
(the matmul FLOPs, 2 x tokens x weights), a square bf16 matmul (the card's GEMM rate measured in
the same run), and the host time to launch the forward (wall time of the Python calls up to
the last launch, before synchronising).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from bench.gpu.decode_e2e import TINY, gpu_ms
from services.worker.accel.cuda_layers import install_cuda_kernels
from services.worker.attention.dense_prefill import DENSE_PREFILL_CHOICES
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.models.random_init import PRESETS, build_random_model
from services.worker.runner.kv_cache import KVCache


def prefill_inputs(spans: int, prompt: int, block: int, device: str) -> dict[str, np.ndarray]:
    q_lens = np.full(spans, prompt)
    width = -(-prompt // block)
    tables = np.arange(spans * width).reshape(spans, width)
    pos = np.tile(np.arange(prompt), spans)
    rows = np.repeat(np.arange(spans), prompt)
    slots = tables[rows, pos // block] * block + pos % block
    return {"query_lens": q_lens, "seq_lens": q_lens, "block_tables": tables,
            "slot_mapping": slots, "positions": pos}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--spans", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    hf_config = TINY if args.dry_run else PRESETS[args.preset]
    if args.dry_run:
        args.spans, args.prompt, args.repeats = 2, 24, 1
    block = 16
    model, config = build_random_model(hf_config, dtype, device, max(1024, args.prompt))
    if device == "cuda":
        install_cuda_kernels(model)
    arrays = prefill_inputs(args.spans, args.prompt, block, device)
    tokens = args.spans * args.prompt
    kv = KVCache.allocate(config, tokens // block + 1, block, dtype, device)
    ids = torch.randint(0, config.vocab_size, (tokens,), device=device)
    positions = torch.from_numpy(arrays["positions"]).to(device)
    meta_args = {k: v for k, v in arrays.items() if k != "positions"}

    def forward(dense: bool) -> None:
        meta = TritonAttentionMetadata.build(
            **meta_args, block_size=block, num_kv_heads=config.num_key_value_heads,
            device=device, dense_prefill=dense,
        )  # fmt: skip
        model(ids, positions, meta, kv.layers)

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [w for w in weights if w.shape[0] != config.vocab_size]  # LM head: last rows only
    x = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=dtype, device=device) for w in weights}

    def linears() -> None:
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)

    n = 8192 if device == "cuda" else 256
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                              "torch": torch.__version__, "tokens": tokens, "spans": args.spans,
                              "prompt": args.prompt}  # fmt: skip
    with torch.inference_mode():
        result["forward_dense_ms"] = gpu_ms(lambda: forward(True), args.repeats)
        result["forward_paged_ms"] = gpu_ms(lambda: forward(False), args.repeats)
        result["linears_ms"] = gpu_ms(linears, args.repeats)
        result["matmul_ms"] = gpu_ms(lambda: a @ b, args.repeats)
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        forward(True)
        result["host_launch_ms"] = (time.perf_counter() - started) * 1000
    flops = 2 * tokens * sum(w.numel() for w in weights)
    result["linear_flops"] = flops
    result["linears_TFLOPs"] = round(flops / result["linears_ms"] / 1e9, 1)
    result["matmul_TFLOPs"] = round(2 * n**3 / result["matmul_ms"] / 1e9, 1)
    result["dense_impl"] = {"|".join(map(str, k)): v for k, v in DENSE_PREFILL_CHOICES.items()}
    for key in ("forward_dense_ms", "forward_paged_ms"):
        result[key.replace("_ms", "_tok_s")] = round(tokens / result[key] * 1000, 1)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
