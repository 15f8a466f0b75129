"""Every serving kernel against its reference compiled on the GPU, at Llama-3-8B sizes (32 q / 8
kv heads, head_dim 128, hidden 4096, page 16) and the contexts that stress the launchers (32k
keys, a ragged batch, windows, fp8 caches, inserts past the grid cut-off). tests/kernels checks
the same kernels at small sizes, in the interpreter on CPU.

Outputs are poisoned with NaN first, so an element a kernel never writes fails the check;
attention and GEMV outputs are compared as ||out - ref|| / ||ref||, inserts and norms bit for
bit (or to 2 ulp for the normed output)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshllm_kernels.attention.kv_insert import insert_kv, insert_qkv, kv_insert_reference
from meshllm_kernels.attention.paged_decode import paged_decode_attention, paged_decode_reference
from meshllm_kernels.attention.paged_prefill import paged_prefill_attention, paged_prefill_reference
from meshllm_kernels.decode_chain.gemv import gemv
from meshllm_kernels.layers.rmsnorm import rmsnorm, rmsnorm_reference
from meshllm_kernels.runtime.staged_copy import CpuGpuBuffer, stage_to_device
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

DEVICE = torch.device("cuda")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 32, 8, 128, 16
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
GEMV_SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]


def _batch(seq_lens: list[int], q_lens: list[int], **kw: Any) -> PagedBatch:
    kw.setdefault("dtype", torch.bfloat16)
    return make_paged_batch(
        seq_lens, q_lens, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        page=PAGE, device=DEVICE, **kw,
    )  # fmt: skip


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "an output element was never written"
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm())


MIXED = ([1024, 3512, 8192, 7500], [1024, 512, 1, 1500])


@pytest.mark.parametrize(
    ("lens", "make_kw", "kw"),
    [
        (MIXED, {}, {}),
        (([1024, 9700, 8192], [1024, 700, 1]), {}, {"sliding_window": 4096}),
        (([32768, 9000], [8, 8]), {}, {"causal": False}),  # draft blocks over 32k keys
        (MIXED, {"dtype": torch.float16}, {}),
        (MIXED, {"cache_dtype": FP8_E4M3}, {}),
        (MIXED, {"cache_dtype": FP8_E4M3, "per_head_scale": True}, {"sliding_window": 2048}),
    ],
    ids=["bf16", "bf16-window", "bf16-noncausal-draft", "fp16", "fp8", "fp8-per-head-window"],
)
def test_prefill(lens: tuple[list[int], list[int]], make_kw: dict, kw: dict) -> None:
    b = _batch(*lens, **make_kw)
    args = (b.q, b.kv_cache, b.block_tables, b.cu_seqlens_q, b.seq_lens)
    out = torch.full_like(b.q, float("nan"))
    paged_prefill_attention(*args, out=out, **b.scales, **kw)
    ref = paged_prefill_reference(*args, **b.scales, **kw)
    assert _rel(out, ref) < REL_TOL[b.q.dtype]


@pytest.mark.parametrize("splits", [None, 1, 7])
@pytest.mark.parametrize(
    ("seq_lens", "make_kw", "kw"),
    [
        ([32768], {}, {}),
        ([32768, 1, 17, 4096, 16384, 32000, 8191, 100], {}, {}),
        ([32768], {}, {"sliding_window": 4096}),
        ([32768, 30000, 5, 12345], {"cache_dtype": FP8_E4M3, "per_head_scale": True}, {}),
    ],
    ids=["bf16-b1-32k", "bf16-b8-ragged", "bf16-b1-window", "fp8-per-head-b4"],
)
def test_decode(seq_lens: list[int], make_kw: dict, kw: dict, splits: int | None) -> None:
    b = _batch(seq_lens, [1] * len(seq_lens), **make_kw)
    args = (b.q, b.kv_cache, b.block_tables, b.seq_lens)
    out = torch.full_like(b.q, float("nan"))
    paged_decode_attention(*args, out=out, num_splits=splits, **b.scales, **kw)
    ref = paged_decode_reference(*args, **b.scales, **kw)
    assert _rel(out, ref) < REL_TOL[b.q.dtype]


def _cos_sin(max_pos: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (500000 ** (torch.arange(0, rot, 2, device=DEVICE).float() / rot))
    angles = torch.outer(torch.arange(max_pos, device=DEVICE).float(), inv)
    return torch.cat([angles.cos(), angles.sin()], -1)


@pytest.mark.parametrize(
    ("tokens", "cache_dtype", "neox", "rot", "per_head_k"),
    [
        (16384 + 123, torch.bfloat16, True, HEAD_DIM, False),
        (16384 + 123, FP8_E4M3, True, HEAD_DIM, True),
        (4099, torch.float16, False, 64, False),  # GPT-J rotary on 64 of 128 dims
        (131072 + 17, torch.bfloat16, True, HEAD_DIM, False),  # past the grid's cut-off
    ],
    ids=["bf16", "fp8-per-head-k", "fp16-gptj-rot64", "bf16-131k"],
)
def test_kv_insert(
    tokens: int, cache_dtype: torch.dtype, neox: bool, rot: int, per_head_k: bool
) -> None:
    """Q+KV and KV-only inserts write the same bytes as the reference, rotate Q the same, and
    leave the slots they skip (-1) untouched."""
    torch.manual_seed(tokens)
    scales: dict[str, torch.Tensor] = {}
    if cache_dtype == FP8_E4M3:
        scales = {"v_scale": torch.tensor(0.02, device=DEVICE)}
        scales["k_scale"] = (
            torch.linspace(0.01, 0.03, KV_HEADS, device=DEVICE)
            if per_head_k
            else torch.tensor(0.02, device=DEVICE)
        )
    blocks = tokens // PAGE + 16
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.randperm(blocks * PAGE, device=DEVICE)[:tokens]
    slots[::97] = -1
    pos = torch.randint(0, 32768, (tokens,), device=DEVICE)
    cos_sin = _cos_sin(32768, rot)
    base = torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, device=DEVICE).to(cache_dtype)
    c_qkv, c_kv, c_ref = base.clone(), base.clone(), base.clone()
    q_rot = insert_qkv(q, k, v, c_qkv, slots, pos, cos_sin, is_neox=neox, **scales)
    insert_kv(k, v, c_kv, slots, pos, cos_sin, is_neox=neox, **scales)
    q_ref = kv_insert_reference(q, k, v, c_ref, slots, pos, cos_sin, is_neox=neox, **scales)
    assert q_ref is not None
    assert torch.equal(c_qkv.view(torch.uint8), c_ref.view(torch.uint8))
    assert torch.equal(c_kv.view(torch.uint8), c_ref.view(torch.uint8))
    assert torch.equal(q_rot.view(torch.int16), q_ref.view(torch.int16))
    untouched = torch.ones(blocks * PAGE, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    mask = untouched.reshape(blocks, PAGE)
    assert torch.equal(c_qkv[:, mask].view(torch.uint8), base[:, mask].view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 7, 4096])
def test_rmsnorm_residual(rows: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    r = torch.randn(rows, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).to(torch.bfloat16)
    out, res = rmsnorm(x, w, 1e-5, r)
    ref, ref_res = rmsnorm_reference(x, w, 1e-5, r)
    assert res is not None and ref_res is not None
    assert torch.equal(res, ref_res)
    ulps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 2


@pytest.mark.parametrize("rows", [1, 4, 8, 16])
@pytest.mark.parametrize(("n", "k"), GEMV_SHAPES)
def test_gemv(n: int, k: int, rows: int) -> None:
    torch.manual_seed(n + rows)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    assert _rel(gemv(x, w), x.float() @ w.float().t()) < 1e-2


def test_staged_copy_never_hands_out_host_memory_in_flight() -> None:
    buf = CpuGpuBuffer(64 << 20, dtype=torch.float32, device=DEVICE)
    buf.np[:] = 1.0
    on_device = buf.copy_to_gpu()
    buf.cpu.fill_(2.0)  # `.cpu` waits for the copy before it hands the host tensor out
    assert bool((on_device == 1.0).all())
    assert buf.cpu.is_pinned()
    src = torch.arange(1 << 20, dtype=torch.int64)
    out = stage_to_device(src, DEVICE)
    src.zero_()
    assert torch.equal(out.cpu(), torch.arange(1 << 20))
