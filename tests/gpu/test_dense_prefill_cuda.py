"""Dense flash prefill on CUDA (services/worker/attention/dense_prefill.py) against the paged Triton
kernel on the same bf16 inputs: fresh spans, an extend onto a cached prefix and decodes in one
step, Llama-3-8B head geometry (32/8 heads, head_dim 128)."""

from __future__ import annotations

import numpy as np
import torch

from meshllm_kernels.attention.backends import TritonPagedAttention
from services.worker.attention.dense_prefill import DENSE_PREFILL_CHOICES, dense_prefill_impl
from services.worker.attention.select import TritonAttentionMetadata, rotary_attention

HEADS, KV_HEADS, D, BLOCK = 32, 8, 128, 16


def test_bf16_passes_both_probes_and_auto_chooses_flash_varlen() -> None:
    impl = dense_prefill_impl(torch.device("cuda"), torch.bfloat16, HEADS, KV_HEADS, D)
    print("dense prefill choices:", DENSE_PREFILL_CHOICES)
    assert DENSE_PREFILL_CHOICES[("cuda", "torch.bfloat16", HEADS, KV_HEADS, D)] == (
        "flash-varlen",
        "sdpa",
    )
    assert impl == "flash-varlen"


def _meta(q_lens: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray, dense: bool):  # type: ignore[no-untyped-def]
    starts = seq_lens - q_lens
    pos = np.concatenate([np.arange(a, b) for a, b in zip(starts, seq_lens, strict=True)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[rows, pos // BLOCK] * BLOCK + pos % BLOCK
    meta = TritonAttentionMetadata.build(
        query_lens=q_lens, seq_lens=seq_lens, block_tables=tables, block_size=BLOCK,
        slot_mapping=slots, num_kv_heads=KV_HEADS, device="cuda", dense_prefill=dense,
        backend=TritonPagedAttention(),
    )  # fmt: skip
    return meta, pos


def test_dense_prefill_equals_paged_kernel_bf16() -> None:
    torch.manual_seed(0)
    # decode (ctx 700), fresh 300, extend 64 onto 200, fresh 512, fresh 37
    q_lens = np.array([1, 300, 64, 512, 37])
    seq_lens = np.array([700, 300, 264, 512, 37])
    width = 48
    tables = np.arange(1, 1 + width * len(q_lens)).reshape(len(q_lens), width)
    num_blocks = 1 + width * len(q_lens)
    prior = torch.randn(2, num_blocks, BLOCK, KV_HEADS, D, device="cuda").to(torch.bfloat16)
    caches = [prior.clone(), prior.clone()]
    tokens = int(q_lens.sum())
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * D, device="cuda").to(torch.bfloat16)
    outs = []
    for cache, dense in zip(caches, (True, False), strict=True):
        meta, pos = _meta(q_lens, seq_lens, tables, dense)
        assert (meta.dense_prefill is not None) == dense
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        freqs = torch.from_numpy(pos).cuda().float()[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), -1)[:, None, :]
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        with torch.inference_mode():
            outs.append(rotary_attention(qkv, cos, sin, meta, cache, HEADS, KV_HEADS, D, D**-0.5))
    torch.cuda.synchronize()
    assert torch.equal(caches[0], caches[1])  # the same insert on both paths
    dense_out, paged_out = (o.float() for o in outs)
    err = float((dense_out - paged_out).norm() / paged_out.norm())
    print("dense vs paged prefill, rel. error:", err)
    assert err < 1e-2
    # every row was written (the decode and extend rows by the paged kernels)
    assert torch.isfinite(dense_out).all()
    torch.testing.assert_close(dense_out[:1], paged_out[:1], rtol=0, atol=0)


def test_batched_sdpa_agrees_with_the_float32_reference() -> None:
    """`sdpa` on CUDA (cuDNN's attention on the H100) over runs of equal spans batched as one
    call each, grouped KV heads, against the float32 reference."""
    from services.worker.attention.dense_prefill import dense_attention, reference_attention

    lens = [512, 512, 512, 300, 300, 129]
    n = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (
        torch.randn(n, h, D, device="cuda", generator=g).to(torch.bfloat16)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    cu = torch.tensor(np.concatenate(([0], np.cumsum(lens))), dtype=torch.int32, device="cuda")
    out = dense_attention("sdpa", q, k, v, cu, lens, max(lens), D**-0.5)
    ref = reference_attention(q, k, v, lens, D**-0.5)
    assert out.shape == q.shape
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
