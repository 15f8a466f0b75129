"""Correctness of every kernel against its reference at Llama-3-8B sizes, on the GPU.

Inputs are random (never zeros: zeros hide unwritten outputs), outputs are poisoned with NaN
before each run so an unwritten element shows up, and errors are reported as
||out - ref|| / ||ref|| next to the maximum absolute difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.gpu.report import Report
from kernels.attention.kv_insert import insert_kv, insert_qkv, kv_insert_reference
from kernels.attention.paged_decode import paged_decode_attention, paged_decode_reference
from kernels.attention.paged_prefill import paged_prefill_attention, paged_prefill_reference
from kernels.decode_chain.gemv import gemv
from kernels.layers.rmsnorm import rmsnorm, rmsnorm_reference
from kernels.runtime.staged_copy import CpuGpuBuffer, stage_to_device
from kernels.runtime.tensor_checks import FP8_E4M3, FP8_E4M3_MAX

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 14336, 128256
PAGE = 16
GEMV_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


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
    seq_lens: list[int],
    q_lens: list[int],
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | None = None,
    per_head_scale: bool = False,
) -> Paged:
    """Sequences on scattered physical blocks of a real-layout cache, on the GPU."""
    dev = torch.device("cuda")
    cache_dtype = cache_dtype or dtype
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
        n = KV_HEADS if per_head_scale else 1
        ks = torch.rand(n, device=dev) * 0.01 + 0.005
        vs = torch.rand(n, device=dev) * 0.01 + 0.005
        cache = torch.stack(
            [
                (raw[0] / ks.reshape(1, 1, -1, 1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX),
                (raw[1] / vs.reshape(1, 1, -1, 1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX),
            ]
        ).to(FP8_E4M3)
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        cache = raw.to(cache_dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), HEADS, HEAD_DIM, device=dev).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return Paged(q, cache, tables, cu.to(dev), lens, scales, max(seq_lens))


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    o, r = out.double(), ref.double()
    return {
        "rel": float((o - r).norm() / r.norm()),
        "max_abs": float((o - r).abs().max()),
        "nan": float(out.isnan().sum()),
    }


def check_prefill(report: Report) -> None:
    mixed = ([1024, 3512, 8192, 7500], [1024, 512, 1, 1500])
    cases = [
        ("prefill bf16 causal", mixed, {}, {}),
        ("prefill bf16 window 4096", ([1024, 9700, 8192], [1024, 700, 1]), {},
         {"sliding_window": 4096}),
        ("prefill bf16 non-causal draft 8 over 32k", ([32768, 9000], [8, 8]), {},
         {"causal": False}),
        ("prefill fp16 causal", mixed, {"dtype": torch.float16}, {}),
        ("prefill fp8 per-tensor", mixed, {"cache_dtype": FP8_E4M3}, {}),
        ("prefill fp8 per-head window", mixed,
         {"cache_dtype": FP8_E4M3, "per_head_scale": True}, {"sliding_window": 2048}),
    ]  # fmt: skip
    for name, (seq_lens, q_lens), make_kw, kw in cases:
        b = make_paged(seq_lens, q_lens, **make_kw)
        out = torch.full_like(b.q, float("nan"))
        paged_prefill_attention(b.q, b.cache, b.tables, b.cu, b.lens, out=out, **b.scales, **kw)
        ref = paged_prefill_reference(b.q, b.cache, b.tables, b.cu, b.lens, **b.scales, **kw)
        e = errors(out, ref)
        report.check(name, e["rel"] < REL_TOL[b.q.dtype] and e["nan"] == 0, **e)

    # CONTRACTS: qlen=2 over seq_len=10, non-causal: row 0 sees all 10 positions.
    b = make_paged([10], [2])
    b.cache[0] = 0.25  # equal keys: row 0's output is the mean of the values it sees
    args = (b.q, b.cache, b.tables, b.cu, b.lens)
    nc = paged_prefill_attention(*args, causal=False).float()
    causal = paged_prefill_attention(*args, causal=True).float()
    blocks = b.tables[0].long()
    v = b.cache[1, blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:10].float()
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    sees_10 = float((nc[0] - v.mean(0)).abs().max())
    sees_9 = float((causal[0] - v[:9].mean(0)).abs().max())
    differs = float((nc[0] - causal[0]).abs().max())
    report.check(
        "non-causal qlen=2 seq=10: row 0 sees all 10",
        sees_10 < 2e-2 and sees_9 < 2e-2 and differs > 1e-2,
        err_vs_mean10=sees_10, causal_err_vs_mean9=sees_9, nc_minus_causal=differs,
    )  # fmt: skip


def check_decode(report: Report) -> None:
    cases = [
        ("decode bf16 B=1 32k", [32768], {}, {}),
        ("decode bf16 B=8 ragged to 32k", [32768, 1, 17, 4096, 16384, 32000, 8191, 100], {}, {}),
        ("decode bf16 B=1 32k window 4096", [32768], {}, {"sliding_window": 4096}),
        ("decode fp8 per-head B=4 32k", [32768, 30000, 5, 12345],
         {"cache_dtype": FP8_E4M3, "per_head_scale": True}, {}),
    ]  # fmt: skip
    for name, seq_lens, make_kw, kw in cases:
        b = make_paged(seq_lens, [1] * len(seq_lens), **make_kw)
        ref = paged_decode_reference(b.q, b.cache, b.tables, b.lens, **b.scales, **kw)
        for splits in (None, 1, 7):
            out = torch.full_like(b.q, float("nan"))
            paged_decode_attention(
                b.q, b.cache, b.tables, b.lens, out=out, num_splits=splits, **b.scales, **kw
            )
            e = errors(out, ref)
            report.check(
                f"{name} splits={splits or 'auto'}",
                e["rel"] < REL_TOL[b.q.dtype] and e["nan"] == 0, **e,
            )  # fmt: skip


def _cos_sin(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (500000 ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    f = torch.outer(torch.arange(max_pos, device="cuda").float(), inv)
    return torch.cat([f.cos(), f.sin()], -1)


def check_kv_insert(report: Report) -> None:
    cases = [
        ("insert 16507 tok bf16 neox", 16384 + 123, torch.bfloat16, True, HEAD_DIM, {}),
        ("insert 16507 tok fp8 neox per-head k", 16384 + 123, FP8_E4M3, True, HEAD_DIM,
         {"k_scale": torch.linspace(0.01, 0.03, KV_HEADS, device="cuda"),
          "v_scale": torch.tensor(0.02, device="cuda")}),
        ("insert 4099 tok fp16 gptj rot64", 4099, torch.float16, False, 64, {}),
        ("insert 131089 tok bf16 (past grid cut-off)", 131072 + 17, torch.bfloat16, True,
         HEAD_DIM, {}),
    ]  # fmt: skip
    for name, tokens, cache_dtype, neox, rot, scales in cases:
        blocks = tokens // PAGE + 16
        q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        slots = torch.randperm(blocks * PAGE, device="cuda")[:tokens]
        slots[::97] = -1
        pos = torch.randint(0, 32768, (tokens,), device="cuda")
        cs = _cos_sin(32768, rot)
        base = torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, device="cuda").to(cache_dtype)
        c_qkv, c_kv, c_ref = base.clone(), base.clone(), base.clone()
        q_rot = insert_qkv(q, k, v, c_qkv, slots, pos, cs, is_neox=neox, **scales)
        insert_kv(k, v, c_kv, slots, pos, cs, is_neox=neox, **scales)
        q_ref = kv_insert_reference(q, k, v, c_ref, slots, pos, cs, is_neox=neox, **scales)
        same = torch.equal(c_qkv.view(torch.uint8), c_kv.view(torch.uint8))
        differ_ref = int((c_qkv.view(torch.uint8) != c_ref.view(torch.uint8)).sum())
        assert q_ref is not None
        q_diff = int((q_rot.view(torch.int16) != q_ref.view(torch.int16)).sum())
        untouched = torch.ones(blocks * PAGE, dtype=torch.bool, device="cuda")
        untouched[slots[slots >= 0]] = False
        mask = untouched.reshape(blocks, PAGE)
        kept = torch.equal(c_qkv[:, mask].view(torch.uint8), base[:, mask].view(torch.uint8))
        report.check(
            name, same and kept and differ_ref == 0 and q_diff == 0,
            kv_only_equals_qkv=same, bytes_differing_from_reference=differ_ref,
            q_elems_differing=q_diff, skipped_slots_untouched=kept,
        )  # fmt: skip


def check_rmsnorm(report: Report) -> None:
    for rows in (1, 7, 4096):
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
        out, res = rmsnorm(x, w, 1e-5, r)
        ref, ref_res = rmsnorm_reference(x, w, 1e-5, r)
        assert res is not None and ref_res is not None
        ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
        report.check(
            f"rmsnorm+residual bf16 {rows}x{HIDDEN}",
            torch.equal(res, ref_res) and int(ulps.max()) <= 2,
            residual_exact=torch.equal(res, ref_res), max_ulp=int(ulps.max()),
            frac_differing=float((ulps > 0).float().mean()),
        )  # fmt: skip


def check_gemv(report: Report) -> None:
    for n, k in GEMV_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 4, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = gemv(x, w)
            ref = x.float() @ w.float().t()
            e = errors(out, ref)
            report.check(f"gemv bf16 {n}x{k} M={m}", e["rel"] < 1e-2 and e["nan"] == 0, **e)


def check_staged_copy(report: Report) -> None:
    buf = CpuGpuBuffer(64 << 20, dtype=torch.float32, device="cuda")
    buf.np[:] = 1.0
    dev = buf.copy_to_gpu()
    buf.cpu.fill_(2.0)  # must wait for the copy before handing out the host memory
    ok = bool((dev == 1.0).all())
    report.check(
        "staged copy: host write after copy_to_gpu does not reach the device",
        ok and buf._cpu.is_pinned(), pinned=buf._cpu.is_pinned(), device_kept_old=ok,
    )  # fmt: skip
    src = torch.arange(1 << 20, dtype=torch.int64)
    out = stage_to_device(src, "cuda")
    src.zero_()
    report.check("stage_to_device copies", bool((out.cpu() == torch.arange(1 << 20)).all()))


ALL_CHECKS = [
    ("check prefill", check_prefill),
    ("check decode", check_decode),
    ("check kv_insert", check_kv_insert),
    ("check rmsnorm", check_rmsnorm),
    ("check gemv", check_gemv),
    ("check staged copy", check_staged_copy),
]
