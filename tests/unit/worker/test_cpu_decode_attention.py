"""The C++ decode attention (meshllm_kernels/attention/cpu_decode.py) against the PyTorch reference
path of services/worker/attention/reference.py, and its launcher's input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshllm_kernels.attention.cpu_decode import (
    SOURCE,
    CpuDecodeAttention,
    KernelUnavailable,
    load,
)
from meshllm_kernels.runtime.cpu_library import load_library
from services.worker.attention.reference import AttentionMetadata, paged_attention
from services.worker.attention.select import cpu_decode_kernel, prebuild_cpu_decode_kernel


@pytest.fixture(scope="module")
def kernel() -> CpuDecodeAttention:
    return load()


@pytest.fixture(scope="module")
def kernels(kernel, tmp_path_factory) -> dict[str, CpuDecodeAttention]:
    """The serving build, and both vector widths built unoptimised (seconds, not tens): the
    width this CPU does not serve with is checked here too (16 floats on AVX2 runs as register
    pairs, 8 on AVX-512 as AVX2 code)."""
    cache = tmp_path_factory.mktemp("cpu-kernels")
    built = {"serving": kernel}
    for width in (8, 16):
        flags = ("-O0", "-march=native", "-fopenmp", "-shared", "-fPIC")
        library = load_library(SOURCE, (*flags, f"-DMESHLLM_VECTOR_WIDTH={width}"), cache)
        built[f"width-{width}"] = CpuDecodeAttention(*library)
    return built


def decode_step(
    *,
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    q_scale: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """A random cache with scattered blocks, one decode row per length, and the step's q/k/v
    (the new token of each sequence is its last position)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    ids = rng.permutation(num_blocks)[: len(lens) * width].reshape(len(lens), width)
    slots = [
        int(ids[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
        for i, n in enumerate(lens)
    ]
    q = (torch.randn(len(lens), heads, head_dim, generator=gen) * q_scale).to(dtype)
    k = torch.randn(len(lens), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(lens), kv_heads, head_dim, generator=gen).to(dtype)
    return cache, torch.from_numpy(ids.astype(np.int64)), torch.tensor(slots), q, k, v


def metadata(lens: list[int], tables: torch.Tensor, slots: torch.Tensor, block_size: int, kernel):
    return AttentionMetadata.build(
        query_lens=np.ones(len(lens), dtype=np.int64),
        seq_lens=np.array(lens),
        block_tables=tables.numpy(),
        block_size=block_size,
        slot_mapping=slots.numpy(),
        decode_kernel=kernel,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "lens"),
    [
        (9, 3, 64, 16, [1, 17, 64, 90, 33, 7, 128, 5]),  # SmolLM2's heads, partial blocks
        (4, 4, 16, 4, [3, 9]),  # no grouping, tiny blocks
        (32, 8, 128, 16, [700, 1]),  # Llama-3-8B's heads
        (8, 1, 32, 1, [40]),  # multi-query, one token per block
    ],
)
@pytest.mark.parametrize("build", ["serving", "width-8", "width-16"])
def test_kernel_matches_the_reference_path(
    kernels: dict[str, CpuDecodeAttention],
    build,
    dtype,
    heads,
    kv_heads,
    head_dim,
    block_size,
    lens,
) -> None:
    kernel = kernels[build]
    cache, tables, slots, q, k, v = decode_step(
        lens=lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    ref_cache, scale = cache.clone(), head_dim**-0.5
    expected = paged_attention(
        q, k, v, ref_cache, metadata(lens, tables, slots, block_size, None), scale
    )
    meta = metadata(lens, tables, slots, block_size, kernel)
    assert meta.decode_step is not None
    out = paged_attention(q, k, v, cache, meta, scale)
    assert torch.equal(cache, ref_cache)  # this step's K/V written into the same slots
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2  # bf16: one rounding of the output
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_saturated_softmax_and_strided_rows(kernel: CpuDecodeAttention) -> None:
    """Scores hundreds apart (probabilities that underflow to 0) and q/k/v that are views into
    one fused qkv projection, as the model passes them."""
    lens, heads, kv_heads, d = [50, 200], 6, 2, 32
    cache, tables, slots, q, k, v = decode_step(
        lens=lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=d,
        block_size=16,
        dtype=torch.float32,
        q_scale=40.0,
    )
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view = qkv[:, : heads * d].view(2, heads, d)
    k_view = qkv[:, heads * d : (heads + kv_heads) * d].view(2, kv_heads, d)
    v_view = qkv[:, (heads + kv_heads) * d :].view(2, kv_heads, d)
    assert not q_view.is_contiguous()
    ref_cache = cache.double()
    meta = metadata(lens, tables, slots, 16, None)
    expected = paged_attention(q.double(), k.double(), v.double(), ref_cache, meta, d**-0.5)
    out = kernel(q_view, k_view, v_view, cache, slots, tables, torch.tensor(lens), d**-0.5)
    assert torch.equal(cache.double(), ref_cache)
    # Scores of magnitude ~1e3 carry fp32 rounding of ~1e-4 into the exponent.
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_mixed_step_writes_every_row_and_attends_the_decodes(kernel: CpuDecodeAttention) -> None:
    """Rows past the decodes (a prefill chunk) are written by the kernel's call too, before the
    reference path reads them for the chunk."""
    torch.manual_seed(3)
    block, kv_heads, heads, d = 4, 2, 4, 16
    cache = torch.randn(2, 12, block, kv_heads, d)
    ref_cache = cache.clone()
    step = dict(
        query_lens=np.array([1, 1, 5]),
        seq_lens=np.array([6, 3, 9]),
        block_tables=np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]]),
        block_size=block,
        slot_mapping=np.array(
            [
                2 * block + 1,
                3 * block + 2,
                5 * block,
                5 * block + 1,
                5 * block + 2,
                5 * block + 3,
                6 * block,
            ]
        ),
    )
    q, k, v = torch.randn(7, heads, d), torch.randn(7, kv_heads, d), torch.randn(7, kv_heads, d)
    expected = paged_attention(q, k, v, ref_cache, AttentionMetadata.build(**step), d**-0.5)
    out = paged_attention(
        q, k, v, cache, AttentionMetadata.build(**step, decode_kernel=kernel), d**-0.5
    )
    assert torch.equal(cache, ref_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_same_result_on_one_thread_and_two(kernel: CpuDecodeAttention) -> None:
    lens = [30, 70, 5, 100]
    cache, tables, slots, q, k, v = decode_step(
        lens=lens, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k, v, cache.clone(), slots, tables, torch.tensor(lens), 0.125)
        torch.set_num_threads(2)
        two = kernel(q, k, v, cache.clone(), slots, tables, torch.tensor(lens), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_metadata_keeps_the_kernel_only_where_it_applies(kernel: CpuDecodeAttention) -> None:
    step = dict(
        query_lens=np.array([1, 1]),
        seq_lens=np.array([5, 8]),
        block_tables=np.array([[0, 1], [2, 3]]),
        block_size=4,
        slot_mapping=np.array([4, 15]),
    )
    meta = AttentionMetadata.build(**step, decode_kernel=kernel)
    assert meta.decode_step is not None and meta.decode_step.seq_lens.tolist() == [5, 8]
    assert meta.decode_mask is not None  # kept for a layer the kernel cannot take
    assert (
        AttentionMetadata.build(**step, decode_kernel=kernel, sliding_window=4).decode_step is None
    )
    prefill = {**step, "query_lens": np.array([5, 8]), "slot_mapping": np.arange(13)}
    assert AttentionMetadata.build(**prefill, decode_kernel=kernel).decode_step is None


def test_layers_the_kernel_cannot_take_use_the_reference_path(kernel: CpuDecodeAttention) -> None:
    """head_dim 8 (not a multiple of 16) and fp16: the metadata carries the kernel, the layer
    still computes through gather + SDPA."""
    for dtype, d in ((torch.float32, 8), (torch.float16, 16)):
        lens = [6, 11]
        cache, tables, slots, q, k, v = decode_step(
            lens=lens, heads=4, kv_heads=2, head_dim=d, block_size=4, dtype=dtype
        )
        assert not kernel.supports(q, cache)
        expected = paged_attention(
            q, k, v, cache.clone(), metadata(lens, tables, slots, 4, None), 0.3
        )
        out = paged_attention(q, k, v, cache, metadata(lens, tables, slots, 4, kernel), 0.3)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_input_errors(kernel: CpuDecodeAttention) -> None:
    lens = [6, 11]
    cache, tables, slots, q, k, v = decode_step(
        lens=lens, heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    seq_lens = torch.tensor(lens)
    with pytest.raises(TypeError, match="k has dtype"):
        kernel(q, k.double(), v, cache, slots, tables, seq_lens, 1.0)
    with pytest.raises(TypeError, match="kv_cache has dtype"):
        kernel(q, k, v, cache.bfloat16(), slots, tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="v has shape"):
        kernel(q, k, v[:1], cache, slots, tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        kernel(q, k, v, cache.transpose(1, 2), slots, tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel(
            q[..., :8],
            k[..., :8],
            v[..., :8],
            cache[..., :8].contiguous(),
            slots,
            tables,
            seq_lens,
            1.0,
        )
    three = torch.tensor([6, 11, 2])
    with pytest.raises(ValueError, match="3 sequence lengths for 2 block tables"):
        kernel(q, k, v, cache, slots, tables, three, 1.0)
    with pytest.raises(ValueError, match="3 sequence lengths for 2 query rows"):
        kernel(q, k, v, cache, slots, torch.cat([tables, tables[:1]]), three, 1.0)
    with pytest.raises(TypeError, match="seq_lens has dtype"):
        kernel(q, k, v, cache, slots, tables, seq_lens.int(), 1.0)
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        kernel(q, k, v, cache, slots[:1], tables, seq_lens, 1.0)


def test_choice_of_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    assert cpu_decode_kernel("torch", "cpu") is None
    assert cpu_decode_kernel("auto", "meta") is None  # not a CPU runner
    assert isinstance(cpu_decode_kernel("auto", "cpu"), CpuDecodeAttention)
    load.cache_clear()
    prebuild_cpu_decode_kernel("torch", "cpu")
    prebuild_cpu_decode_kernel("auto", "meta")
    assert load.cache_info().currsize == 0  # neither would use the kernel
    prebuild_cpu_decode_kernel("auto", "cpu")  # the worker's start, beside the model's
    assert load.cache_info().currsize == 1
    built = load()
    assert cpu_decode_kernel("auto", "cpu") is built  # the runner takes the library built
    monkeypatch.setenv("CXX", "no-such-compiler")
    load.cache_clear()
    try:
        with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
            load(tmp_path)
        prebuild_cpu_decode_kernel("kernel", "cpu")  # no build: reported by the runner's call
        assert cpu_decode_kernel("auto", "cpu") is None
        with pytest.raises(KernelUnavailable):
            cpu_decode_kernel("kernel", "cpu")
    finally:
        load.cache_clear()


def test_indexes_outside_the_cache_are_refused_before_the_kernel_runs(
    kernel: CpuDecodeAttention,
) -> None:
    """The C++ code trusts its indexes, so every slot, block id and length is checked against
    the cache first (the reference path would raise an IndexError)."""
    lens = [6, 11]
    cache, tables, slots, q, k, v = decode_step(
        lens=lens, heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    num_blocks = cache.shape[1]
    before = cache.clone()
    seq_lens = torch.tensor(lens)
    bad_slots = slots.clone()
    bad_slots[1] = num_blocks * 4
    with pytest.raises(ValueError, match=r"slot_mapping .* outside"):
        kernel(q, k, v, cache, bad_slots, tables, seq_lens, 1.0)
    bad_tables = tables.clone()
    bad_tables[0, 0] = num_blocks
    with pytest.raises(ValueError, match=r"block_tables .* outside"):
        kernel(q, k, v, cache, slots, bad_tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match=r"seq_lens .* outside"):
        kernel(q, k, v, cache, slots, tables, torch.tensor([6, tables.shape[1] * 4 + 1]), 1.0)
    with pytest.raises(ValueError, match=r"seq_lens .* outside"):
        kernel(q, k, v, cache, slots, tables, torch.tensor([0, 11]), 1.0)
    assert torch.equal(cache, before)  # nothing was written


def test_a_step_checks_each_new_layer_geometry(kernel: CpuDecodeAttention) -> None:
    lens = [6, 11]
    cache, tables, slots, q, k, v = decode_step(
        lens=lens, heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32
    )
    step = kernel.step(slots, tables, torch.tensor(lens))
    step(q, k, v, cache, 0.25)  # the first layer: checked in full
    small = torch.zeros(2, 2, 4, 2, 16)  # a later "layer" whose cache is too small
    with pytest.raises(ValueError, match="outside the cache's 2 blocks"):
        step(q, k, v, small, 0.25)
    with pytest.raises(TypeError, match="kv_cache has dtype"):
        step(q, k, v, cache.bfloat16(), 0.25)
