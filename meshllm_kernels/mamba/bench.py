"""Time the Mamba2 state kernels and report the bytes they must move.

    python -m meshllm_kernels.mamba.bench                 # a GPU: Bamba-9B-like layer shapes
    TRITON_INTERPRET=1 python -m meshllm_kernels.mamba.bench --tiny   # anywhere (interpreter, slow)

Expected: decode is bound by the SSM state traffic. A Bamba-9B layer (128 heads x 64 x 128
state) holds 1 Mi state values per request: 8 MiB read + written per request and layer with
an fp32 pool (4 MiB with bf16), about 2 us per request-layer at ~4 TB/s on an H200, so a batch
of 64 should take ~120 us per layer when the kernel streams at bandwidth; the conv state
(conv_dim x 3 values) is ~1% of that. Prefill reads xBC and dt once per (head, head_dim tile)
program and writes y, plus one state read/write per request and boundary; its time is the
chunk loop's small matrix products (requests x heads programs, each sequential over chunks).

Measured once on one H200 (torch 2.11, Triton 3.6; bf16 activations, fp32 SSM pool, defaults):
decode step, batch 64: 152 us, 548 MB moved, 3.6 TB/s. Prefill of 2048 + 1000 + 37 tokens:
0.73 ms with the chunked scan (4.2 M tokens/s per layer), 3.0 ms with the sequential one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from meshllm_kernels.mamba.cases import random_batch, random_params, random_pools
from meshllm_kernels.mamba.decode_step import mamba_decode_step
from meshllm_kernels.mamba.prefill import mamba_prefill


def _time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Mean seconds per call (after one warm-up call)."""
    fn()
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=50) / 1e3
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def bench(
    batch: int = 64,
    prefill_lens: tuple[int, ...] = (2048, 1000, 37),
    n_heads: int = 128,
    head_dim: int = 64,
    n_groups: int = 1,
    d_state: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    ssm_dtype: torch.dtype = torch.float32,
    chunk_size: int | None = 64,
    device: str | None = None,
    reps: int = 1,
) -> dict[str, float]:
    """Times of one decode step over `batch` rows and one prefill of `prefill_lens`, with the
    bytes each must move and the implied bandwidth."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    p = random_params(n_heads, head_dim, n_groups, d_state, dtype=dtype, device=dev)
    blocks = 2 * batch + 2 * len(prefill_lens) + 1
    conv, ssm = random_pools(p, blocks, dtype, ssm_dtype)
    dec = random_batch(p, [1] * batch, reads=list(range(batch)),
                       writes=list(range(batch, 2 * batch)), dtype=dtype)  # fmt: skip
    t_dec = _time(lambda: mamba_decode_step(dec.xBC, dec.dt, p, conv, ssm, dec.read_slot,
                                            dec.write_slot), dev, reps)  # fmt: skip
    ssm_bytes = ssm[0].numel() * ssm.element_size()
    conv_bytes = conv[0].numel() * conv.element_size()
    act = dtype.itemsize
    dec_bytes = batch * (2 * ssm_bytes + 2 * conv_bytes + 3 * p.conv_dim * act + p.d_inner * act)
    R = len(prefill_lens)
    pre = random_batch(p, list(prefill_lens), reads=list(range(R)),
                       writes=list(range(2 * batch, 2 * batch + R)), dtype=dtype)  # fmt: skip
    t_pre = _time(lambda: mamba_prefill(pre.xBC, pre.dt, pre.cu_seqlens, p, conv, ssm,
                                        pre.read_slot, pre.write_slot, chunk_size=chunk_size),
                  dev, reps)  # fmt: skip
    T = sum(prefill_lens)
    pre_bytes = R * (2 * ssm_bytes + 2 * conv_bytes) + T * (3 * p.conv_dim + p.d_inner) * act
    return {
        "decode_s": t_dec,
        "decode_bytes": dec_bytes,
        "decode_GBps": dec_bytes / t_dec / 1e9,
        "prefill_s": t_pre,
        "prefill_tokens": T,
        "prefill_tokens_per_s": T / t_pre,
        "prefill_GBps": pre_bytes / t_pre / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="shapes the interpreter can run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sequential", action="store_true", help="prefill with the sequential scan")
    args = ap.parse_args()
    chunk = None if args.sequential else 64
    if args.tiny:
        res = bench(batch=2, prefill_lens=(20, 3), n_heads=4, head_dim=4, n_groups=2, d_state=8,
                    dtype=torch.float32, chunk_size=None if args.sequential else 16)  # fmt: skip
    else:
        res = bench(batch=args.batch, chunk_size=chunk)
    for k, v in res.items():
        print(f"{k:22s} {v:.4g}")


if __name__ == "__main__":
    main()
