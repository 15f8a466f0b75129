"""Decode attention at the batch-256 decode step's shape on the GPU: the launcher's single
pass on its many-programs tiles (meshllm_kernels.attention.paged_decode.single_pass_tiles) against
the reference, at Llama-3-8B heads (32 q / 8 kv, head_dim 128), bf16, ragged lengths."""

from __future__ import annotations

import torch

from meshllm_kernels.attention.paged_decode import (
    DECODE_TILES_MANY_PROGRAMS,
    paged_decode_attention,
    paged_decode_reference,
    single_pass_tiles,
)
from tests.kernels.paged_batch import make_paged_batch, tolerance


def test_batch_256_single_pass_matches_reference() -> None:
    torch.manual_seed(0)
    lens = [1 + (37 * i) % 700 for i in range(256)]
    batch = make_paged_batch(
        lens, [1] * len(lens), num_heads=32, num_kv_heads=8, head_dim=128, page=16,
        dtype=torch.bfloat16, device=torch.device("cuda"),
    )  # fmt: skip
    assert single_pass_tiles(256, 8, batch.kv_cache.element_size()) == DECODE_TILES_MANY_PROGRAMS
    ref = paged_decode_reference(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, out=out,
        max_seq_len=max(lens),
    )  # fmt: skip
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance(torch.bfloat16), rtol=0)
