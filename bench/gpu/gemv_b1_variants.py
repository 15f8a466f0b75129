"""One-row GEMV variants against the decode GEMV (kernels/decode_chain/gemv.py) at the Llama-3-8B layer
shapes, on the H200 (issue #9: the batch-1 step's weight streams run at 3.3-3.9 TB/s where the
LM head's long stream gets ~4.5).

- dot:  kernels.decode_chain.gemv's product (tensor cores, the weight tile through shared memory by cp.async),
        its own tuned config, fp32 split-K partials out (as the decode chain launches it);
- core: no tensor cores: each program multiplies [BLOCK_N, BLOCK_K] weight tiles loaded
        straight into registers (16-byte loads) by x and sums along K at the end (the shape of
        the GEMV that torch.compile writes for one row);
- tma:  the dot kernel with the weight tile loaded by the bulk tensor copy engine
        (a host-side TensorDescriptor: TMA + mbarrier pipelining).

Each config is timed as 32 launches with their own weights in one CUDA graph (so every launch
streams from HBM, as in a decode step), PDL on as in the decode chain; then the best of each
variant per shape are replayed in rotation. Outputs are checked against an fp32 product.

These figures are of one kernel repeated, launch after launch: in the decode chain the same
configs gave nothing (bench/gpu/gemv_b1_h200.log, gemv_row_h200.log). Tune for the chain with
bench/gpu/gemv_chain_sweep.py.

    python3 -m bench.gpu.gemv_b1_variants [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import triton
import triton.language as tl

from bench.gpu.graph_replays import captured, rotating_replays
from kernels.decode_chain.gemv import H200_CONFIGS, GemvConfig, heuristic_config

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAUNCHES = 32


@triton.jit
def _core_kernel(
    x_ptr, w_ptr, part_ptr, N, K, k_per_split, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_per_split
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :])
        x = tl.load(x_ptr + offs_k).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(part_ptr + pid_k * N + offs_n, tl.sum(acc, axis=1))


@triton.jit
def _tma_kernel(
    x_ptr, w_desc, part_ptr, N, K, k_per_split,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, F32: tl.constexpr = False,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, 16)
    k_start = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        w = w_desc.load([n0, k])
        x_ptrs = x_ptr + offs_m[None, :] * 0 + offs_k[:, None]
        x = tl.load(x_ptrs, mask=offs_m[None, :] < 1, other=0.0)
        if F32:  # the interpreter's dot has no bf16
            acc += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w, x)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(part_ptr + pid_k * N + offs_n, tl.sum(acc, axis=1))  # columns 1.. are zero


def _dot_launch(cfg: GemvConfig, x, w, part, pdl):  # type: ignore[no-untyped-def]
    from kernels.decode_chain.gemv import _gemv_kernel

    n, k = w.shape
    kps = k // cfg.split_k
    _gemv_kernel[(n // cfg.block_n, cfg.split_k)](
        x, w, part, part, 1, n, k, kps, x.stride(0), w.stride(0), part.stride(0),
        BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_PARTIALS=True,
        EVEN_K=True, EVEN_N=True, FP32_DOT=False, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )  # fmt: skip


def _core_launch(cfg: GemvConfig, x, w, part, pdl):  # type: ignore[no-untyped-def]
    n, k = w.shape
    _core_kernel[(n // cfg.block_n, cfg.split_k)](
        x, w, part, n, k, k // cfg.split_k, w.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )  # fmt: skip


def _tma_launch(cfg: GemvConfig, x, w, part, pdl, desc):  # type: ignore[no-untyped-def]
    n, k = w.shape
    _tma_kernel[(n // cfg.block_n, cfg.split_k)](
        x, desc, part, n, k, k // cfg.split_k,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl, F32=not x.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )  # fmt: skip


def core_configs(quick: bool, fine: bool = False) -> list[GemvConfig]:
    tiles = [(8, 512), (16, 512), (32, 256), (16, 1024)] if not quick else [(16, 512)]
    warps, stages = (4, 8), (1, 3)
    if fine:  # around the first sweep's winners: smaller row tiles, fewer warps
        tiles, warps, stages = [(4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024)], (2, 4, 8), (1,)
    out = []
    for (bn, bk), nw, ns in itertools.product(tiles, warps, stages):
        for split in (1, 2, 4):
            out.append(GemvConfig(bn, bk, split, nw, ns))
    return out


def tma_configs(quick: bool) -> list[GemvConfig]:
    tiles = [(64, 128), (128, 128), (64, 256)] if not quick else [(64, 128)]
    out = []
    for (bn, bk), ns in itertools.product(tiles, (3, 4, 6)):
        for split in (1, 2, 4):
            out.append(GemvConfig(bn, bk, split, 4, ns))
    return out


def _valid(cfg: GemvConfig, n: int, k: int) -> bool:
    kps = k // cfg.split_k
    return n % cfg.block_n == 0 and k % cfg.split_k == 0 and kps % cfg.block_k == 0


class Shape:
    """32 weights of one shape, x, and a partials buffer; graphs per (variant, config)."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAUNCHES)
        ]
        self.x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        self.part = torch.empty(4, 1, n, device="cuda", dtype=torch.float32)
        self.ref = (self.x.float() @ self.weights[0].float().t()).flatten()
        self.descs: dict[tuple[int, int], list] = {}  # type: ignore[type-arg]

    def launches(self, variant: str, cfg: GemvConfig) -> list:  # type: ignore[type-arg]
        if variant == "dot":
            return [lambda w=w: _dot_launch(cfg, self.x, w, self.part, True) for w in self.weights]
        if variant == "core":
            return [lambda w=w: _core_launch(cfg, self.x, w, self.part, True) for w in self.weights]
        from triton.tools.tensor_descriptor import TensorDescriptor

        key = (cfg.block_n, cfg.block_k)
        if key not in self.descs:
            self.descs[key] = [
                TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]) for w in self.weights
            ]
        return [
            lambda w=w, d=d: _tma_launch(cfg, self.x, w, self.part, True, d)
            for w, d in zip(self.weights, self.descs[key], strict=True)
        ]

    def error(self, variant: str, cfg: GemvConfig) -> float:
        self.part.zero_()
        self.launches(variant, cfg)[0]()
        got = self.part[: cfg.split_k, 0].sum(0)
        return float((got - self.ref).norm() / self.ref.norm())

    def graph(self, variant: str, cfg: GemvConfig) -> torch.cuda.CUDAGraph:
        calls = self.launches(variant, cfg)

        def run() -> None:
            for c in calls:
                c()

        return captured(run)


def per_launch_us(graph: torch.cuda.CUDAGraph, replays: int = 7) -> float:
    return statistics.median(rotating_replays({"g": graph}, replays)["g"]) / LAUNCHES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=["qkv", "o", "gate_up", "down"])
    ap.add_argument("--variants", nargs="*", default=["dot", "core", "tma"])
    ap.add_argument("--fine", action="store_true", help="finer CUDA-core tiles")
    args = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in args.shapes:
        n, k = SHAPES[name]
        shape = Shape(n, k)
        mb = n * k * 2 / 1e6
        own = H200_CONFIGS.get((n, k)) or heuristic_config(n, k, num_sms)
        candidates = {
            "dot": [own],
            "core": core_configs(args.quick, args.fine),
            "tma": tma_configs(args.quick),
        }
        best: dict[str, tuple[float, GemvConfig]] = {}
        for variant, cfgs in candidates.items():
            if variant not in args.variants:
                continue
            results = []
            for cfg in cfgs:
                if not _valid(cfg, n, k):
                    continue
                try:
                    err = shape.error(variant, cfg)
                    us = per_launch_us(shape.graph(variant, cfg))
                except Exception as exc:  # a config over a resource limit
                    print(f"  {name} {variant} {cfg} failed: {type(exc).__name__} {str(exc)[:80]}")
                    continue
                if err > 2e-2:
                    print(f"  {name} {variant} {cfg} WRONG: rel err {err:.2e}")
                    continue
                results.append((us, cfg))
            results.sort(key=lambda r: r[0])
            print(f"{name} {n}x{k} {variant}: top 3 of {len(results)}")
            for us, cfg in results[:3]:
                print(f"    {cfg}  {us:7.2f} us  {mb / us:5.2f} TB/s")
            if results:
                best[variant] = results[0]
        graphs = {v: shape.graph(v, cfg) for v, (_, cfg) in best.items()}
        times = rotating_replays(graphs, 21)
        line = "  ".join(
            f"{v} {statistics.median(t) / LAUNCHES:6.2f} us "
            f"({mb / (statistics.median(t) / LAUNCHES):4.2f} TB/s)"
            for v, t in times.items()
        )
        print(f"== {name} rotated, per launch: {line}")
        del shape, graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
