"""Paged decode attention: split-K against single-pass and the reference."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention import paged_decode
from meshllm_kernels.attention.paged_decode import (
    DECODE_TILES_MANY_PROGRAMS,
    DECODE_TILES_SINGLE_PASS,
    MANY_PROGRAMS,
    default_num_splits,
    few_programs,
    paged_decode_attention,
    paged_decode_reference,
    single_pass_tiles,
)
from meshllm_kernels.runtime import completion_counters
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3, interpreting
from tests.kernels.paged_batch import make_paged_batch, tolerance

SEQ_LENS = [1, 37, 150, 64]  # one key only, ragged, long enough for many tiles, page-aligned


def _decode(batch, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, out=out,
        **batch.scales, **kw,
    )  # fmt: skip
    assert not out.isnan().any(), "some output rows were never written"
    return out.float()


def _batch(device, dtype=torch.float16, **kw):  # type: ignore[no-untyped-def]
    return make_paged_batch(
        SEQ_LENS, [1] * len(SEQ_LENS), num_heads=kw.pop("num_heads", 8),
        num_kv_heads=kw.pop("num_kv_heads", 2), head_dim=32, page=kw.pop("page", 16),
        dtype=dtype, device=device, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_k_matches_single_pass_and_reference(device, dtype, window) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(device, dtype)
    ref = paged_decode_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, sliding_window=window
    ).float()
    single = _decode(batch, num_splits=1, sliding_window=window)
    torch.testing.assert_close(single, ref, atol=tolerance(dtype), rtol=0)
    # 3 and 7 pieces: uneven splits, and pieces left empty for the 1-key sequence.
    for splits in (3, 7):
        split = _decode(batch, num_splits=splits, sliding_window=window)
        torch.testing.assert_close(split, ref, atol=tolerance(dtype), rtol=0)
        torch.testing.assert_close(split, single, atol=tolerance(dtype), rtol=0)


def test_default_split_choice_matches_reference(device) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(device, num_heads=4, num_kv_heads=4, page=4)
    ref = paged_decode_reference(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    torch.testing.assert_close(_decode(batch), ref.float(), atol=tolerance(torch.float16), rtol=0)


@pytest.mark.parametrize("per_head_scale", [False, True])
def test_fp8_cache(device, per_head_scale) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(device, cache_dtype=FP8_E4M3, per_head_scale=per_head_scale)
    ref = paged_decode_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, **batch.scales
    ).float()
    for splits in (1, 4):
        torch.testing.assert_close(
            _decode(batch, num_splits=splits), ref, atol=tolerance(torch.float16), rtol=0
        )


def test_decode_equals_prefill_of_one_token(device) -> None:  # type: ignore[no-untyped-def]
    from meshllm_kernels.attention.paged_prefill import paged_prefill_attention

    batch = _batch(device)
    cu = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32, device=device)
    prefill = paged_prefill_attention(
        batch.q, batch.kv_cache, batch.block_tables, cu, batch.seq_lens
    ).float()
    torch.testing.assert_close(
        _decode(batch, num_splits=5), prefill, atol=tolerance(torch.float16), rtol=0
    )


def test_padded_sequence_of_length_zero_gives_zeros(device) -> None:  # type: ignore[no-untyped-def]
    """CUDA-graph padding rows have seq_len 0: finite zeros, never NaN."""
    batch = _batch(device)
    batch.seq_lens[0] = 0
    for splits in (1, 3):
        out = _decode(batch, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_default_num_splits() -> None:
    # Batch 1, 8 kv heads, 32k context on 132 SMs: about two waves; 33 pieces would leave the
    # last one empty (pieces are whole 128-key tiles), so 32.
    assert default_num_splits(1, 8, 32768, 132) == 32
    assert default_num_splits(1, 8, 32768 + 128 * 33, 132) == 33  # where 33 all hold keys
    # With more programs, a short context is never cut below 256 keys a piece.
    assert default_num_splits(4, 8, 300, 132) == 2
    # A large batch already fills the GPU.
    assert default_num_splits(64, 8, 32768, 132) == 1
    # Batch 1-2 (few programs) at short contexts: a piece per 64-key tile, up to 16 (the
    # strided kernel's latency-bound case); from 4k keys on the long-context rule again.
    assert few_programs(2, 8, 132) and not few_programs(4, 8, 132)
    assert default_num_splits(1, 8, 300, 132) == 5
    assert default_num_splits(1, 8, 512, 132) == 8
    assert default_num_splits(2, 8, 512, 132) == 8
    assert default_num_splits(1, 8, 2048, 132) == 16
    assert default_num_splits(1, 8, 4096, 132) == 16
    assert default_num_splits(1, 8, 40, 132) == 1


def test_single_pass_tiles_choice() -> None:
    # 32-key tiles on 2 warps from MANY_PROGRAMS (sequence, kv head) pairs on 16-bit caches.
    assert MANY_PROGRAMS == 1024
    assert single_pass_tiles(128, 8, 2) == DECODE_TILES_MANY_PROGRAMS
    assert single_pass_tiles(256, 4, 2) == DECODE_TILES_MANY_PROGRAMS
    assert single_pass_tiles(127, 8, 2) == DECODE_TILES_SINGLE_PASS
    assert single_pass_tiles(256, 8, 1) == DECODE_TILES_SINGLE_PASS  # fp8 keeps its tiles


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_many_programs_tiles_match_reference(device, dtype) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(device, dtype)
    ref = paged_decode_reference(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    out = _decode(batch, num_splits=1, tiles=DECODE_TILES_MANY_PROGRAMS)
    torch.testing.assert_close(out, ref.float(), atol=tolerance(dtype), rtol=0)


# The strided kernel: pieces take every num_splits-th tile (first block ids loaded with
# seq_len), merged by the last piece to finish, or by a second kernel where the merger's
# registers do not allow that.


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_kernel_matches_reference(device, dtype) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(device, dtype)
    batch.seq_lens[2] = 0  # a padding row between real ones: zeros, never NaN
    ref = paged_decode_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens
    ).float()
    # 3 pieces: several tiles each; 7: pieces left empty for the short sequences. Three
    # launches in a row: each fused merge must leave its counters at zero for the next.
    completion_counters.clear()
    for splits in (3, 7, 7, 7):
        out = _decode(batch, num_splits=splits, strided=True)
        torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=0)
        assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert completion_counters.allocated(paged_decode.MERGE_COUNTERS), "the merge never ran"
    assert completion_counters.all_zero()


def test_strided_pieces_merged_by_the_second_kernel_where_registers_run_out(device) -> None:  # type: ignore[no-untyped-def]
    """16 query heads a kv head over 40 pieces: more than the last piece can hold to merge
    them (merge_counters gives none), so the reduce kernel merges the strided pieces."""
    batch = _batch(device, torch.bfloat16, num_heads=32)
    tiles = paged_decode.INTERPRETER_TILES if interpreting() else paged_decode.strided_tiles(32, 2)
    assert paged_decode.merge_counters(4, 2, 16, 40, 32, tiles, batch.q.device) is None
    ref = paged_decode_reference(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    out = _decode(batch, num_splits=40, strided=True)
    torch.testing.assert_close(out, ref.float(), atol=tolerance(torch.bfloat16), rtol=0)


@pytest.mark.parametrize("per_head_scale", [False, True])
def test_strided_kernel_fp8_cache(device, per_head_scale) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(device, cache_dtype=FP8_E4M3, per_head_scale=per_head_scale, num_heads=4)
    ref = paged_decode_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, **batch.scales
    ).float()
    out = _decode(batch, num_splits=4, strided=True)
    torch.testing.assert_close(out, ref, atol=tolerance(torch.float16), rtol=0)


def test_strided_request_with_a_window_runs_the_windowed_kernel(device) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(device, torch.bfloat16)
    ref = paged_decode_reference(
        batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, sliding_window=20
    ).float()
    out = _decode(batch, num_splits=3, sliding_window=20, strided=True)
    torch.testing.assert_close(out, ref, atol=tolerance(torch.bfloat16), rtol=0)


def test_launcher_picks_the_strided_kernel_for_many_splits(device) -> None:  # type: ignore[no-untyped-def]
    """16+ pieces without a window: the strided kernel with the fused merge by default."""
    batch = _batch(device, torch.bfloat16)
    ref = paged_decode_reference(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    completion_counters.clear()
    out = _decode(batch, num_splits=paged_decode.STRIDED_MIN_SPLITS)
    torch.testing.assert_close(out, ref.float(), atol=tolerance(torch.bfloat16), rtol=0)
    assert completion_counters.allocated(paged_decode.MERGE_COUNTERS), "the merge never ran"
    assert completion_counters.all_zero()
    assert paged_decode.strided_tiles(128, 2).block_n == 64  # 16 KB of bf16 K per tile
    assert paged_decode.strided_tiles(128, 1).block_n == 128  # and of fp8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_merge_kept_inside_a_cuda_graph(device) -> None:  # type: ignore[no-untyped-def]
    """Counters allocated by an eager call are found inside a capture on another stream (a
    capture that fell back to the second kernel would lose the fused merge's time), and
    every replay leaves them at zero for the next."""
    batch = _batch(device, torch.bfloat16)
    ref = paged_decode_reference(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens)
    out = torch.full_like(batch.q, float("nan"))

    def call() -> None:
        paged_decode_attention(
            batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, out=out,
            num_splits=paged_decode.STRIDED_MIN_SPLITS,
        )  # fmt: skip

    call()  # eager: allocates the counters
    family = paged_decode.MERGE_COUNTERS
    counters = completion_counters.counters(family, batch.q.device, 1)
    assert counters is completion_counters.counters(family, device, 1)  # "cuda" = current
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert completion_counters.counters(family, batch.q.device, 1) is counters
        call()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), ref.float(), atol=tolerance(torch.bfloat16), rtol=0)
    assert counters is not None and not counters.any()
