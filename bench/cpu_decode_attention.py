"""One decode layer's paged attention on CPU: the C++ kernel (kernels/attention/cpu_decode.py)
against the PyTorch reference path (gather + SDPA), both through `paged_attention` as the
model calls it, alternating in one process (this VM's speed drifts between runs).

    python -m bench.cpu_decode_attention            # SmolLM2's heads, bf16, 2 threads
    python -m bench.cpu_decode_attention --heads 32 --kv-heads 8 --head-dim 128

Reports the best of `--repeats` timings of `--calls` calls per case, in microseconds.
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch

from kernels.attention.cpu_decode import load
from services.worker.attention.reference import AttentionMetadata, paged_attention

CASES = ((1, 64), (1, 2048), (8, 64), (8, 256), (8, 1024), (32, 256))


def best_us(fn, calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernel = load()
    bs, heads, kv_heads, d = args.block_size, args.heads, args.kv_heads, args.head_dim
    print(f"heads {heads}/{kv_heads}, head_dim {d}, {args.dtype}, {args.threads} threads")
    print(f"{'seqs':>5} {'keys':>6} {'torch us':>9} {'kernel us':>10} {'speedup':>8}")
    rng = np.random.default_rng(0)
    for seqs, keys in CASES:
        width = -(-keys // bs)
        num_blocks = seqs * width + 1
        cache = torch.randn(2, num_blocks, bs, kv_heads, d).to(dtype)
        tables = rng.permutation(np.arange(1, num_blocks))[: seqs * width].reshape(seqs, width)
        lens = np.full(seqs, keys)
        slots = tables[:, (keys - 1) // bs] * bs + (keys - 1) % bs
        step = dict(
            query_lens=np.ones(seqs, dtype=np.int64),
            seq_lens=lens,
            block_tables=tables,
            block_size=bs,
            slot_mapping=slots,
        )
        q = torch.randn(seqs, heads, d).to(dtype)
        k, v = (torch.randn(seqs, kv_heads, d).to(dtype) for _ in range(2))
        metas = {
            "torch": AttentionMetadata.build(**step),
            "kernel": AttentionMetadata.build(**step, decode_kernel=kernel),
        }
        us = {}
        for name, meta in metas.items():
            layer = functools.partial(paged_attention, q, k, v, cache, meta, d**-0.5)
            us[name] = best_us(layer, args.calls, args.repeats)
        print(
            f"{seqs:>5} {keys:>6} {us['torch']:>9.1f} {us['kernel']:>10.1f} "
            f"{us['torch'] / us['kernel']:>7.2f}x"
        )


if __name__ == "__main__":
    main()
