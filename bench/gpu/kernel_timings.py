"""Timings at Llama-3-8B sizes: median of triton.testing.do_bench, bytes and FLOPs counted.

do_bench zeroes a 256 MB buffer before every call, which flushes L2 (so weights that would fit
in the H200's 60 MB L2 are still read from HBM) and keeps the GPU busy while the next launch is
queued (so Python launch overhead is not counted). Bytes are the fewest a kernel must move:
each input read once, each output written once.
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from bench.gpu.kernel_checks import (
    GEMV_SHAPES,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    _cos_sin,
    make_paged,
)
from bench.gpu.report import Report
from kernels.gemv import GemvConfig, gemv, heuristic_config
from kernels.kv_insert import insert_kv, insert_qkv
from kernels.paged_attention import paged_prefill_attention
from kernels.paged_decode import paged_decode_attention
from kernels.rmsnorm import rmsnorm, rmsnorm_reference
from kernels.staged_copy import CpuGpuBuffer
from kernels.tensor_checks import FP8_E4M3

SDPA = torch.nn.functional.scaled_dot_product_attention


def median_ms(fn, fast: bool = False) -> float:  # type: ignore[no-untyped-def]
    warmup, rep = (5, 20) if fast else (25, 100)
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_hbm_ceiling(report: Report) -> None:
    src = torch.randn(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    report.timing("d2d copy (ceiling)", "2 GiB", ms, bytes_moved=2 * src.numel() * 4)
    ms = median_ms(lambda: src.sum())
    report.timing("read-only sum (ceiling)", "2 GiB", ms, bytes_moved=src.numel() * 4)


def gemv_candidates(n: int, k: int) -> list[GemvConfig]:
    out = []
    for bn, bk, nw, ns in [
        (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4),
        (128, 128, 8, 4), (64, 64, 4, 6), (128, 64, 4, 6),
    ]:  # fmt: skip
        for split in (1, 2, 4, 8, 16):
            if k // (bk * split) >= 2:
                out.append(GemvConfig(bn, bk, split, nw, ns))
    return out


def gemv_bytes(m: int, n: int, k: int) -> int:
    return 2 * (n * k + m * k + m * n)


def time_gemv(report: Report) -> dict[tuple[int, int], GemvConfig]:
    """Sweep configs at batch 1, then time the best at 1/4/8/16 against cuBLAS."""
    best: dict[tuple[int, int], GemvConfig] = {}
    step = {"triton": 0.0, "cublas": 0.0}
    # Per Llama-3-8B layer: q and o (4096x4096), k and v (1024x4096), gate and up
    # (14336x4096), down (4096x14336); 32 layers, then the LM head once.
    per_layer = {(4096, 4096): 2, (1024, 4096): 2, (14336, 4096): 2, (4096, 14336): 1}
    for n, k in GEMV_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        sweep = []
        for cfg in gemv_candidates(n, k):
            try:
                sweep.append((median_ms(lambda c=cfg, x1=x1, w=w: gemv(x1, w, c), fast=True), cfg))
            except Exception as exc:  # a config the compiler rejects is skipped
                report.notes.append(f"gemv {n}x{k} {cfg} failed: {exc!r}"[:300])
        sweep.sort(key=lambda t: t[0])
        best[(n, k)] = sweep[0][1]
        heur = heuristic_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        report.notes.append(
            f"gemv {n}x{k} sweep top3: "
            + "; ".join(f"{c} {ms * 1e3:.1f}us" for ms, c in sweep[:3])
            + f" | heuristic {heur}"
        )
        for m in (1, 4, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = median_ms(lambda x=x, w=w, c=best[(n, k)]: gemv(x, w, c))
            ms_h = median_ms(lambda x=x, w=w, c=heur: gemv(x, w, c))
            ms_cublas = median_ms(lambda x=x, w=w: torch.matmul(x, w.t()))
            report.timing(
                "gemv (tuned)", f"{n}x{k} M={m}", ms, bytes_moved=gemv_bytes(m, n, k),
                flops=2 * m * n * k, baseline="cuBLAS", baseline_ms=ms_cublas,
                heuristic_us=ms_h * 1e3,
            )  # fmt: skip
            if m == 1:
                layers = per_layer.get((n, k), 0) * 32 or 1
                step["triton"] += layers * ms
                step["cublas"] += layers * ms_cublas
    report.notes.append(
        f"decode-step weight GEMVs at batch 1 (32 layers + LM head, sum of medians): "
        f"triton {step['triton']:.3f} ms, cuBLAS {step['cublas']:.3f} ms"
    )
    return best


def time_decode(report: Report) -> None:
    cases = [
        ("bf16", [32768], {}), ("bf16", [32768] * 8, {}), ("bf16", [4096] * 64, {}),
        ("fp8", [32768], {"cache_dtype": FP8_E4M3}),
    ]  # fmt: skip
    for label, lens, kw in cases:
        b = make_paged(lens, [1] * len(lens), **kw)
        elem = b.cache.element_size()
        nbytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * elem + 2 * b.q.numel() * 2
        flops = 4 * HEADS * HEAD_DIM * sum(lens)
        shape = f"{label} B={len(lens)} ctx={lens[0]}"
        ms_1 = median_ms(
            lambda b=b, n=lens[0]: paged_decode_attention(
                b.q, b.cache, b.tables, b.lens, num_splits=1, max_seq_len=n, **b.scales
            )
        )
        ms = median_ms(
            lambda b=b, n=lens[0]: paged_decode_attention(
                b.q, b.cache, b.tables, b.lens, max_seq_len=n, **b.scales
            )
        )
        report.timing(
            "decode attention (split-K auto)", shape, ms, bytes_moved=nbytes, flops=flops,
            baseline="same, 1 split", baseline_ms=ms_1,
        )  # fmt: skip


def time_prefill(report: Report) -> None:
    for ctx, qlen in ((0, 4096), (8192, 512), (0, 16384)):
        seq = ctx + qlen
        b = make_paged([seq], [qlen])
        visible = sum(ctx + i + 1 for i in range(qlen))
        flops = 4 * HEADS * HEAD_DIM * visible
        ms = median_ms(
            lambda b=b, q=qlen: paged_prefill_attention(
                b.q, b.cache, b.tables, b.cu, b.lens, max_seqlen_q=q
            )
        )
        base = None
        if ctx == 0:  # torch SDPA (flash) on contiguous K/V of the same data
            blocks = b.tables[0].long()
            k = b.cache[0, blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:seq].transpose(0, 1)
            v = b.cache[1, blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:seq].transpose(0, 1)
            k = k.repeat_interleave(HEADS // KV_HEADS, 0)[None].contiguous()
            v = v.repeat_interleave(HEADS // KV_HEADS, 0)[None].contiguous()
            qq = b.q.transpose(0, 1)[None].contiguous()
            base = median_ms(lambda qq=qq, k=k, v=v: SDPA(qq, k, v, is_causal=True))
        report.timing(
            "prefill attention causal", f"bf16 ctx={ctx} q={qlen}", ms, flops=flops,
            baseline="torch SDPA" if base else None, baseline_ms=base,
        )  # fmt: skip


def time_kv_insert(report: Report) -> None:
    tokens = 16384
    blocks = tokens // 16 + 16
    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(blocks * 16, device="cuda")[:tokens]
    pos = torch.randint(0, 32768, (tokens,), device="cuda")
    cs = _cos_sin(32768, HEAD_DIM)
    for label, dtype, scales in (
        ("bf16", torch.bfloat16, {}),
        ("fp8", FP8_E4M3, {"k_scale": torch.tensor(0.02, device="cuda"),
                           "v_scale": torch.tensor(0.02, device="cuda")}),
    ):  # fmt: skip
        cache = torch.zeros(2, blocks, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        kv_in = 2 * k.numel() * 2
        kv_out = 2 * k.numel() * cache.element_size()
        ms = median_ms(lambda c=cache, s=scales: insert_qkv(q, k, v, c, slots, pos, cs, **s))
        report.timing(
            "kv_insert Q+KV", f"{label} T={tokens}", ms,
            bytes_moved=kv_in + kv_out + 2 * q.numel() * 2,
        )  # fmt: skip
        ms = median_ms(lambda c=cache, s=scales: insert_kv(k, v, c, slots, pos, cs, **s))
        report.timing("kv_insert KV-only", f"{label} T={tokens}", ms, bytes_moved=kv_in + kv_out)


def time_rmsnorm(report: Report) -> None:
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 16, 4096):
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        ms = median_ms(lambda x=x, r=r: rmsnorm(x, w, 1e-5, r))
        base = median_ms(lambda x=x, r=r: rmsnorm_reference(x, w, 1e-5, r))
        report.timing(
            "rmsnorm+residual", f"bf16 {rows}x{HIDDEN}", ms, bytes_moved=4 * x.numel() * 2,
            baseline="torch eager", baseline_ms=base,
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


ALL_TIMINGS = [
    ("time hbm ceiling", time_hbm_ceiling),
    ("time gemv", time_gemv),
    ("time decode", time_decode),
    ("time prefill", time_prefill),
    ("time kv_insert", time_kv_insert),
    ("time rmsnorm", time_rmsnorm),
    ("time staged copy", time_staged_copy),
]
