"""Timings at Llama-3-8B sizes: median of triton.testing.do_bench, bytes and FLOPs counted.

do_bench zeroes a 256 MB buffer before every call, which flushes L2 (so weights that would fit
in the H200's 60 MB L2 are still read from HBM) and keeps the GPU busy while the next launch is
queued (so Python launch overhead is not counted). Bytes are the fewest a kernel must move:
each input read once, each output written once.
"""

from __future__ import annotations

import itertools

import torch
from triton.testing import do_bench

from bench.gpu.graph_replays import captured
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
from kernels.attention.kv_insert import insert_kv, insert_qkv
from kernels.attention.paged_decode import paged_decode_attention
from kernels.attention.paged_prefill import paged_prefill_attention
from kernels.attention.tile_step import AttentionTiles
from kernels.decode_chain.gemv import GemvConfig, gemv, heuristic_config
from kernels.layers.rmsnorm import rmsnorm, rmsnorm_reference
from kernels.runtime.staged_copy import CpuGpuBuffer
from kernels.runtime.tensor_checks import FP8_E4M3

SDPA = torch.nn.functional.scaled_dot_product_attention


def median_ms(fn, fast: bool = False) -> float:  # type: ignore[no-untyped-def]
    """Eager time (do_bench median, L2 flushed): includes launch gaps the flush cannot hide."""
    warmup, rep = (5, 20) if fast else (25, 100)
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "L2_cache_size", 60 << 20))


def copies_for(nbytes: int) -> int:
    """Input copies to rotate through so each call reads HBM, not L2 (4x the L2 in total)."""
    return max(1, min(32, -(-4 * l2_bytes() // max(1, nbytes))))


def graph_ms(calls: list, replays: int = 7) -> float:  # type: ignore[type-arg]
    """GPU time per call: `calls` captured round-robin in one CUDA graph, median of replays.

    This is how the worker runs decode (CUDA graphs), so Python launch overhead is excluded;
    rotating through input copies keeps L2 from serving repeated reads.
    """
    for c in calls:  # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    torch.cuda.synchronize()
    rounds = max(1, min(200, int(2.0 / max(start.elapsed_time(end), 1e-3))))

    def run() -> None:
        for _ in range(rounds):
            for c in calls:
                c()

    graph = captured(run)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] / (rounds * len(calls))


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
        (128, 128, 8, 4), (64, 64, 4, 6), (128, 64, 4, 6), (256, 64, 8, 4),
    ]:  # fmt: skip
        for split in (1, 2, 4, 8):
            if k // (bk * split) >= 2:
                out.append(GemvConfig(bn, bk, split, nw, ns))
    return out


def gemv_bytes(m: int, n: int, k: int) -> int:
    return 2 * (n * k + m * k + m * n)


def time_gemv(report: Report) -> dict[tuple[int, int], GemvConfig]:
    """Sweep configs at batch 1 and 16 (graph time), then time the best at 1/4/8/16."""
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
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 4, 8, 16)}

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
        for m in (1, 4, 8, 16):
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
    pdl: bool | None = None,
) -> list:  # type: ignore[type-arg]
    return [
        lambda b=b: paged_decode_attention(
            b.q, b.cache, b.tables, b.lens, max_seq_len=b.max_len, num_splits=splits,
            tiles=tiles, pdl=pdl, **b.scales,
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
    # Programmatic dependent launch of the split-K merge, off vs on, alternating, for the
    # launcher's own choice and the sweep's top 3.
    for _, tiles, splits in [(0.0, None, None), *sweep[:3]]:
        try:
            pair = {
                pdl: [graph_ms(_decode_calls(batches, tiles, splits, pdl)) for _ in range(3)]
                for pdl in (False, True)
            }
        except Exception as exc:
            report.notes.append(f"decode pdl {tiles} splits {splits} failed: {exc!r}"[:300])
            continue
        report.notes.append(
            f"decode B=1 32k {tiles or 'auto'} splits={splits}: pdl off "
            + "/".join(f"{ms * 1e3:.1f}" for ms in pair[False])
            + " us, pdl on "
            + "/".join(f"{ms * 1e3:.1f}" for ms in pair[True])
            + " us"
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


ALL_TIMINGS = [
    ("time hbm ceiling", time_hbm_ceiling),
    ("time gemv", time_gemv),
    ("time decode", time_decode),
    ("time prefill", time_prefill),
    ("time kv_insert", time_kv_insert),
    ("time rmsnorm", time_rmsnorm),
    ("time staged copy", time_staged_copy),
]
