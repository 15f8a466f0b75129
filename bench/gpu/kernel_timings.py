"""Kernel micro-benchmarks at Llama-3-8B sizes on a CUDA GPU, each beside its bytes moved
(GB/s, % of the measured 4.2 TB/s HBM read rate of the H200), FLOPs and a baseline (cuBLAS,
torch SDPA, torch ops, one split):

- HBM ceilings (device copy, read-only sum) of this run;
- GEMV (meshllm_kernels/decode_chain/gemv.py): a tile sweep per layer shape (graph time at 1 + 16
  rows; the winners print as the body of gemv.py's H200_CONFIGS), then 1/4/8/16/32/64 rows vs
  cuBLAS and the sum over one batch-1 decode step's weight products;
- paged decode attention: a tile/split sweep at batch 1, 32k keys, then bf16 batch 1/8 at 32k,
  batch 64 at 4k, fp8 batch 1 at 32k;
- paged prefill attention (causal; vs SDPA on contiguous K/V), the dense prefill path's
  implementations on packed fresh spans (eager: SDPA's cuDNN graph is built on the host), KV
  insert with fused RoPE, RMSNorm+residual, the pinned staged host->device copy;
- `F.linear` at a Llama-3-8B layer's fused weights (qkv, o, gate_up, down) and 64 / 128 / 256 /
  8,192 rows through cuBLASLt against cuBLAS (torch's default), the library torch's
  `preferred_blas_library` picks (#36: cuBLAS runs the decode GEMMs at 75-92% of their limit).

Times are per call inside a CUDA graph (the worker runs decode in graphs, so launch overhead is
not counted), median of replays, inputs rotated across copies that together exceed L2 so each
call reads HBM. Correctness is the tests' job (tests/kernels, tests/gpu), not this program's.

    python3 -m bench.gpu.kernel_timings --out $OUT/kernel_timings.json [--only gemv,decode]

Each part runs on its own: a failing part is reported and the others still run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu.graph_timing import Report, copies_for, graph_ms, median_ms
from meshllm_kernels.attention.kv_insert import insert_kv, insert_qkv
from meshllm_kernels.attention.paged_decode import paged_decode_attention
from meshllm_kernels.attention.paged_prefill import paged_prefill_attention
from meshllm_kernels.attention.tile_step import AttentionTiles
from meshllm_kernels.decode_chain.gemv import GemvConfig, gemv, heuristic_config
from meshllm_kernels.layers.rmsnorm import rmsnorm, rmsnorm_reference
from meshllm_kernels.runtime.staged_copy import CpuGpuBuffer
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3, FP8_E4M3_MAX

SDPA = torch.nn.functional.scaled_dot_product_attention
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
PAGE = 16
# (N, K) of every weight of a Llama-3-8B decode step: q and o, k and v, gate and up, down,
# and the LM head.
GEMV_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]


@dataclass
class Paged:
    q: torch.Tensor
    cache: torch.Tensor
    tables: torch.Tensor
    cu: torch.Tensor
    lens: torch.Tensor
    scales: dict[str, torch.Tensor]
    max_len: int = 0


def make_paged(
    seq_lens: list[int], q_lens: list[int], cache_dtype: torch.dtype = torch.bfloat16
) -> Paged:
    """Sequences on scattered physical blocks of a real-layout cache (fp8: per-tensor scales)."""
    dev = torch.device("cuda")
    blocks = [(s + PAGE - 1) // PAGE for s in seq_lens]
    num_blocks = sum(blocks) + 8
    perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=dev)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used : used + n]
        used += n
    raw = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev)
    scales: dict[str, torch.Tensor] = {}
    if cache_dtype == FP8_E4M3:
        ks, vs = (torch.rand(1, device=dev) * 0.01 + 0.005 for _ in range(2))
        cache = torch.stack(
            [(raw[0] / ks).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX),
             (raw[1] / vs).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)]
        ).to(FP8_E4M3)  # fmt: skip
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        cache = raw.to(cache_dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), HEADS, HEAD_DIM, device=dev).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return Paged(q, cache, tables, cu.to(dev), lens, scales, max(seq_lens))


def cos_sin(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (500000 ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    f = torch.outer(torch.arange(max_pos, device="cuda").float(), inv)
    return torch.cat([f.cos(), f.sin()], -1)


def time_hbm_ceiling(report: Report) -> None:
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    report.timing("d2d copy (ceiling)", "2 GiB", ms, bytes_moved=2 * src.numel() * 4)
    ms = median_ms(lambda: src.sum())
    report.timing("read-only sum (ceiling)", "2 GiB", ms, bytes_moved=src.numel() * 4)


# Rows timed per shape: the decode chain's (up to 16), and 32 / 64, where steps run cuBLAS today
# (#36: cuBLAS reads qkv, o and down at 75-81% of the H100's read rate at 64 rows).
GEMV_ROWS = (1, 4, 8, 16, 32, 64)


def gemv_candidates(n: int, k: int) -> list[GemvConfig]:
    out = []
    for bn, bk, nw, ns in [
        (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4),
        (128, 128, 8, 4), (64, 64, 4, 6), (128, 64, 4, 6), (256, 64, 8, 4),
    ]:  # fmt: skip
        for split in (1, 2, 4, 8):
            if k // (bk * split) >= 2:
                out.append(GemvConfig(bn, bk, split, nw, ns))
    return out


def gemv_bytes(m: int, n: int, k: int) -> int:
    return 2 * (n * k + m * k + m * n)


def time_gemv(report: Report) -> dict[tuple[int, int], GemvConfig]:
    """Sweep configs at batch 1 and 16 (graph time), then time the best at GEMV_ROWS."""
    best: dict[tuple[int, int], GemvConfig] = {}
    step = {"triton": 0.0, "cublas": 0.0}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # Per Llama-3-8B layer: q and o (4096x4096), k and v (1024x4096), gate and up
    # (14336x4096), down (4096x14336); 32 layers, then the LM head once.
    per_layer = {(4096, 4096): 2, (1024, 4096): 2, (14336, 4096): 2, (4096, 14336): 1}
    for n, k in GEMV_SHAPES:
        ws = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(copies_for(n * k * 2))
        ]
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in GEMV_ROWS}

        def calls(m: int, cfg: GemvConfig | None, ws=ws, xs=xs) -> list:  # type: ignore[no-untyped-def,type-arg]
            if cfg is None:
                return [lambda w=w: torch.matmul(xs[m], w.t()) for w in ws]
            return [lambda w=w: gemv(xs[m], w, cfg) for w in ws]

        sweep = []
        for cfg in gemv_candidates(n, k):
            try:
                sweep.append((graph_ms(calls(1, cfg)) + graph_ms(calls(16, cfg)), cfg))
            except Exception as exc:  # a config the compiler rejects is skipped
                report.notes.append(f"gemv {n}x{k} {cfg} failed: {exc!r}"[:300])
        sweep.sort(key=lambda t: t[0])
        best[(n, k)] = sweep[0][1]
        heur = heuristic_config(n, k, sms)
        report.notes.append(
            f"gemv {n}x{k} sweep (us at M=1 + M=16) top3: "
            + "; ".join(f"{c} {ms * 1e3:.1f}" for ms, c in sweep[:3])
            + f" | heuristic {heur}"
        )
        for m in GEMV_ROWS:
            ms = graph_ms(calls(m, best[(n, k)]))
            ms_h = graph_ms(calls(m, heur))
            ms_cublas = graph_ms(calls(m, None))
            eager = median_ms(lambda x=xs[m], w=ws[0], c=best[(n, k)]: gemv(x, w, c))
            report.timing(
                "gemv (tuned, graph)", f"{n}x{k} M={m}", ms, bytes_moved=gemv_bytes(m, n, k),
                flops=2 * m * n * k, baseline="cuBLAS graph", baseline_ms=ms_cublas,
                heuristic_us=ms_h * 1e3, eager_us=eager * 1e3,
            )  # fmt: skip
            if m == 1:
                layers = per_layer.get((n, k), 0) * 32 or 1
                step["triton"] += layers * ms
                step["cublas"] += layers * ms_cublas
    report.notes.append(
        f"decode-step weight GEMVs at batch 1 (32 layers + LM head, sum of graph times): "
        f"triton {step['triton']:.3f} ms, cuBLAS {step['cublas']:.3f} ms"
    )
    return best


def _decode_calls(
    batches: list,  # type: ignore[type-arg]
    tiles: AttentionTiles | None,
    splits: int | None,
) -> list:  # type: ignore[type-arg]
    return [
        lambda b=b: paged_decode_attention(
            b.q, b.cache, b.tables, b.lens, max_seq_len=b.max_len, num_splits=splits,
            tiles=tiles, **b.scales,
        )
        for b in batches
    ]  # fmt: skip


def time_decode(report: Report) -> None:
    # Sweep tiles and split counts at batch 1, 32k context (the latency case).
    batches = [make_paged([32768], [1]) for _ in range(2)]
    sweep = []
    grid = itertools.product((64, 128), (4, 8), (2, 3, 4), (None, 16, 24, 32, 48, 64))
    for bn, nw, ns, splits in grid:
        tiles = AttentionTiles(block_n=bn, num_warps=nw, num_stages=ns)
        try:
            sweep.append((graph_ms(_decode_calls(batches, tiles, splits)), tiles, splits))
        except Exception as exc:
            report.notes.append(f"decode tiles {tiles} splits {splits} failed: {exc!r}"[:300])
    sweep.sort(key=lambda t: t[0])
    report.notes.append(
        "decode B=1 32k sweep top5: "
        + "; ".join(f"{t} splits={sp} {ms * 1e3:.1f}us" for ms, t, sp in sweep[:5])
    )
    cases = [
        ("bf16", [32768], {}), ("bf16", [32768] * 8, {}), ("bf16", [4096] * 64, {}),
        ("fp8", [32768], {"cache_dtype": FP8_E4M3}),
    ]  # fmt: skip
    for label, lens, kw in cases:
        bs = [make_paged(lens, [1] * len(lens), **kw) for _ in range(2)]
        elem = bs[0].cache.element_size()
        nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * elem + 2 * bs[0].q.numel() * 2
        flops = 4 * HEADS * HEAD_DIM * sum(lens)
        shape = f"{label} B={len(lens)} ctx={lens[0]}"
        ms = graph_ms(_decode_calls(bs, None, None))  # the launcher's own tile choice
        ms_1 = graph_ms(_decode_calls(bs, None, 1))
        best_t, best_s = sweep[0][1], sweep[0][2]
        ms_best = graph_ms(_decode_calls(bs, best_t, best_s))
        report.timing(
            "decode attention (graph, split-K auto)", shape, ms, bytes_moved=nbytes,
            flops=flops, baseline="same, 1 split", baseline_ms=ms_1,
            sweep_best_us=ms_best * 1e3,
        )  # fmt: skip
        del bs


PREFILL_SWEEP = [
    AttentionTiles(64, 64, 4, 2), AttentionTiles(64, 64, 4, 3), AttentionTiles(128, 64, 8, 2),
    AttentionTiles(128, 64, 8, 3), AttentionTiles(128, 32, 4, 3), AttentionTiles(64, 32, 4, 3),
    AttentionTiles(128, 128, 8, 2), AttentionTiles(64, 128, 4, 2),
]  # fmt: skip


def time_prefill(report: Report) -> None:
    for ctx, qlen in ((0, 4096), (8192, 512), (0, 16384)):
        seq = ctx + qlen
        b = make_paged([seq], [qlen])
        visible = sum(ctx + i + 1 for i in range(qlen))
        flops = 4 * HEADS * HEAD_DIM * visible

        def call(t: AttentionTiles | None, b=b, qlen=qlen) -> list:  # type: ignore[no-untyped-def,type-arg]
            return [
                lambda: paged_prefill_attention(
                    b.q, b.cache, b.tables, b.cu, b.lens, max_seqlen_q=qlen, tiles=t
                )
            ]

        sweep = []
        for t in PREFILL_SWEEP if qlen <= 4096 else []:
            try:
                sweep.append((graph_ms(call(t)), t))
            except Exception as exc:
                report.notes.append(f"prefill tiles {t} failed: {exc!r}"[:300])
        sweep.sort(key=lambda x: x[0])
        if sweep:
            report.notes.append(
                f"prefill ctx={ctx} q={qlen} sweep top3: "
                + "; ".join(f"{t} {ms * 1e3:.1f}us" for ms, t in sweep[:3])
            )
        ms = graph_ms(call(None))
        base = None
        if ctx == 0:  # torch SDPA (flash) on contiguous K/V of the same data
            blocks = b.tables[0].long()
            k = b.cache[0, blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:seq].transpose(0, 1)
            v = b.cache[1, blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:seq].transpose(0, 1)
            k = k.repeat_interleave(HEADS // KV_HEADS, 0)[None].contiguous()
            v = v.repeat_interleave(HEADS // KV_HEADS, 0)[None].contiguous()
            qq = b.q.transpose(0, 1)[None].contiguous()
            base = graph_ms([lambda qq=qq, k=k, v=v: SDPA(qq, k, v, is_causal=True)])
        report.timing(
            "prefill attention causal (graph)", f"bf16 ctx={ctx} q={qlen}", ms, flops=flops,
            baseline="torch SDPA" if base else None, baseline_ms=base,
            sweep_best_us=sweep[0][0] * 1e3 if sweep else None,
        )  # fmt: skip


def time_dense_prefill(report: Report) -> None:
    """The dense prefill path's implementations (services/worker/attention/dense_prefill.py)
    on packed causal spans of fresh prompts, grouped KV heads: 16 x 512 is one 8192-token
    chunk of the batch benchmarks' prompts. Eager (do_bench): cuDNN builds its graph on the
    host at the first call of a shape."""
    from services.worker.attention.dense_prefill import IMPLS, dense_attention

    cases = {
        "16x512": [512] * 16,
        "2x4096": [4096] * 2,
        "1x8192": [8192],
        "4 lengths": [2048, 1024, 3072, 2048],
        "8 lengths": [300, 700, 512, 1024, 256, 900, 600, 800],
    }
    for label, lens in cases.items():
        n = sum(lens)
        g = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
        flops = sum(4 * HEADS * HEAD_DIM * m * (m + 1) / 2 for m in lens)
        times: dict[str, float] = {}
        outs: dict[str, torch.Tensor] = {}
        for impl in IMPLS:
            call = functools.partial(
                dense_attention, impl, q, k, v, cu, lens, max(lens), HEAD_DIM**-0.5
            )
            try:
                outs[impl] = call()
                times[impl] = median_ms(call)
            except (RuntimeError, TypeError, NotImplementedError, AttributeError) as exc:
                report.notes.append(f"dense prefill {impl} {label}: {exc!r}"[:300])
        base = times.get("flash-varlen")
        for impl, ms in times.items():
            diff = (
                (outs[impl].float() - outs["flash-varlen"].float()).abs().max().item()
                if ("flash-varlen" in outs)
                else None
            )
            report.timing(
                f"dense prefill {impl}", f"bf16 {label} causal", ms, flops=flops,
                baseline="flash-varlen" if base else None, baseline_ms=base,
                max_abs_diff_vs_flash=diff,
            )  # fmt: skip


def time_kv_insert(report: Report) -> None:
    tokens = 16384
    blocks = tokens // 16 + 16
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(blocks * 16, device="cuda")[:tokens]
    pos = torch.randint(0, 32768, (tokens,), device="cuda")
    cs = cos_sin(32768, HEAD_DIM)
    for label, dtype, scales in (
        ("bf16", torch.bfloat16, {}),
        ("fp8", FP8_E4M3, {"k_scale": torch.tensor(0.02, device="cuda"),
                           "v_scale": torch.tensor(0.02, device="cuda")}),
    ):  # fmt: skip
        cache = torch.zeros(2, blocks, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        kv_in = 2 * k.numel() * 2
        kv_out = 2 * k.numel() * cache.element_size()
        ms = graph_ms([lambda c=cache, s=scales: insert_qkv(q, k, v, c, slots, pos, cs, **s)])
        report.timing(
            "kv_insert Q+KV (graph)", f"{label} T={tokens}", ms,
            bytes_moved=kv_in + kv_out + 2 * q.numel() * 2,
        )  # fmt: skip
        ms = graph_ms([lambda c=cache, s=scales: insert_kv(k, v, c, slots, pos, cs, **s)])
        report.timing(
            "kv_insert KV-only (graph)", f"{label} T={tokens}", ms, bytes_moved=kv_in + kv_out
        )
    for t in (1, 2, 16, 64, 1):  # decode-sized inserts (fp8 cache): latency; T=1 twice
        args = (q[:t], k[:t], v[:t], cache, slots[:t], pos[:t], cs)
        ms = graph_ms([lambda a=args: insert_qkv(*a, **scales)])
        report.timing("kv_insert Q+KV (graph)", f"fp8 T={t}", ms)


def time_rmsnorm(report: Report) -> None:
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 16, 4096):
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        ms = graph_ms([lambda x=x, r=r: rmsnorm(x, w, 1e-5, r)])
        base = graph_ms([lambda x=x, r=r: rmsnorm_reference(x, w, 1e-5, r)])
        report.timing(
            "rmsnorm+residual (graph)", f"bf16 {rows}x{HIDDEN}", ms,
            bytes_moved=4 * x.numel() * 2, baseline="torch eager ops, graph", baseline_ms=base,
        )  # fmt: skip


def time_staged_copy(report: Report) -> None:
    n = 16 << 20  # 64 MB of fp32
    buf = CpuGpuBuffer(n, dtype=torch.float32, device="cuda")
    pageable = torch.randn(n)
    ms = median_ms(lambda: buf.copy_to_gpu())
    base = median_ms(lambda: pageable.to("cuda", non_blocking=True))
    report.timing(
        "staged pinned H2D copy", "64 MB", ms, bytes_moved=n * 4,
        baseline="pageable .to(cuda)", baseline_ms=base,
    )  # fmt: skip


# (N, K) of a Llama-3-8B layer's fused weights, as the worker multiplies them.
LAYER_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                 "down": (4096, 14336)}  # fmt: skip
BLAS_ROWS = (64, 128, 256, 8192)


def time_blas(report: Report) -> None:
    """The same `F.linear` captured under cuBLASLt and under cuBLAS (the baseline)."""
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for name, (n, k) in LAYER_LINEARS.items():
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                  for _ in range(copies_for(n * k * 2))]  # fmt: skip
            for m in BLAS_ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                calls = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws]
                torch.backends.cuda.preferred_blas_library("cublas")
                ms_cublas = graph_ms(calls)
                torch.backends.cuda.preferred_blas_library("cublaslt")
                ms_lt = graph_ms(calls)
                report.timing(
                    "linear cuBLASLt (graph)", f"{name} {n}x{k} M={m}", ms_lt,
                    bytes_moved=gemv_bytes(m, n, k), flops=2 * m * n * k,
                    baseline="cuBLAS graph", baseline_ms=ms_cublas,
                )  # fmt: skip
    finally:
        torch.backends.cuda.preferred_blas_library(default)


PARTS: list[tuple[str, Callable[[Report], Any]]] = [
    ("hbm", time_hbm_ceiling),
    ("gemv", time_gemv),
    ("decode", time_decode),
    ("prefill", time_prefill),
    ("dense_prefill", time_dense_prefill),
    ("kv_insert", time_kv_insert),
    ("rmsnorm", time_rmsnorm),
    ("staged_copy", time_staged_copy),
    ("blas", time_blas),
]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON of every row and note")
    parser.add_argument(
        "--only", default="", help="comma-separated part names: " + ",".join(n for n, _ in PARTS)
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_timings needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    report = Report(
        env={"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
             "triton": triton.__version__, "cuda": torch.version.cuda}
    )  # fmt: skip
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    torch.manual_seed(0)
    best_gemv: dict[tuple[int, int], Any] = {}
    for name, fn in PARTS:
        if wanted and name not in wanted:
            continue
        with report.part(name):
            result = fn(report)
            if name == "gemv":
                best_gemv = result
            torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if best_gemv:
        print("\nH200_CONFIGS = {")
        for (n, k), cfg in best_gemv.items():
            print(f"    ({n}, {k}): {cfg!r},")
        print("}")
    if args.out:
        payload = {"env": report.env, "timings": report.timings, "notes": report.notes,
                   "failures": report.failures}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=1, default=str))
    print(report.markdown())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
