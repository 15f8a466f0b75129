"""KV insertion with fused RoPE: KV-only vs Q+KV byte identity, reference, cut-offs, errors."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention.kv_insert import (
    insert_kv,
    insert_qkv,
    kv_insert_reference,
    rope_reference,
    tokens_per_tile,
)
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3, interpreting
from tests.kernels.rope_cache import cos_sin_cache

CACHE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, FP8_E4M3]


def _inputs(num_tokens, num_heads, num_kv_heads, head_dim, num_slots, device, seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding tokens: skipped
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    return [t.to(device) for t in (q, k, v, slots, positions)]


def _scales(dtype: torch.dtype, num_kv_heads: int, device: torch.device) -> dict:  # type: ignore[type-arg]
    if dtype != FP8_E4M3:
        return {}
    return {
        "k_scale": torch.tensor(0.0123, device=device),
        "v_scale": torch.linspace(0.004, 0.02, num_kv_heads, device=device),
    }


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def assert_cache_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Kernel vs reference cache bytes: equal up to one rounding step of the cache dtype.

    RoPE's fp32 products may be fused (FMA) on the GPU and rounded separately in PyTorch, so
    one ulp of the cache dtype may differ. Under the interpreter two conversions are known to
    be off: fp32->bf16 truncates (one ulp), and fp32->fp8 e4m3 drops the carry into the
    exponent (1.97 becomes 1.0 instead of 2.0); those elements are accepted there only.
    """
    a, b = out.float(), ref.float()
    if out.dtype == FP8_E4M3:
        close = (a - b).abs() <= b.abs() / 8 + 2**-9
        if interpreting():
            carry_bug = (a == b / 2) & (torch.log2(b.abs()).frac() == 0)
            close = close | carry_bug
    else:
        ulp = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-22}[out.dtype]
        close = (a - b).abs() <= b.abs() * ulp + 1e-6
    assert bool(close.all()), f"{int((~close).sum())} cache elements differ from the reference"


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("is_neox", "rotary_dim"), [(True, 32), (False, 32), (True, 16)])
def test_kv_only_and_qkv_write_identical_bytes(device, cache_dtype, is_neox, rotary_dim) -> None:  # type: ignore[no-untyped-def]
    num_tokens, num_heads, num_kv_heads, head_dim, page, blocks = 45, 4, 2, 32, 8, 8
    q, k, v, slots, positions = _inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, page * blocks, device
    )
    cs = cos_sin_cache(4096, rotary_dim, device)
    scales = _scales(cache_dtype, num_kv_heads, device)
    empty = torch.randn(2, blocks, page, num_kv_heads, head_dim, device=device).to(cache_dtype)
    qkv_cache, kv_cache, ref_cache = empty.clone(), empty.clone(), empty.clone()

    q_rot = insert_qkv(q, k, v, qkv_cache, slots, positions, cs, is_neox=is_neox, **scales)
    insert_kv(k, v, kv_cache, slots, positions, cs, is_neox=is_neox, **scales)
    q_ref = kv_insert_reference(q, k, v, ref_cache, slots, positions, cs, is_neox=is_neox, **scales)

    assert torch.equal(_bytes(qkv_cache), _bytes(kv_cache))
    assert_cache_matches_reference(qkv_cache, ref_cache)
    assert q_ref is not None
    torch.testing.assert_close(q_rot.float(), q_ref.float(), atol=0, rtol=2**-7)
    # Padding tokens (slot < 0) wrote nothing: untouched slots keep their old bytes.
    written = torch.zeros(blocks * page, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    untouched = ~written.reshape(blocks, page)
    assert torch.equal(_bytes(qkv_cache)[:, untouched], _bytes(empty)[:, untouched])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_E4M3])
def test_around_the_grid_cutoff(device, cache_dtype) -> None:  # type: ignore[no-untyped-def]
    """With at most 3 tile programs per head, 2..4 tiles' worth of tokens (the loop path)."""
    tile, cutoff = tokens_per_tile(), 3
    cs = cos_sin_cache(4096, 16, device)
    for num_tokens in (cutoff * tile - 1, cutoff * tile, cutoff * tile + 1, 2 * cutoff * tile):
        q, k, v, slots, positions = _inputs(num_tokens, 2, 1, 16, 8 * 32, device, seed=num_tokens)
        scales = _scales(cache_dtype, 1, device)
        caches = [torch.zeros(2, 32, 8, 1, 16, device=device).to(cache_dtype) for _ in range(3)]
        insert_qkv(q, k, v, caches[0], slots, positions, cs, max_tile_programs=cutoff, **scales)
        insert_kv(k, v, caches[1], slots, positions, cs, max_tile_programs=cutoff, **scales)
        kv_insert_reference(None, k, v, caches[2], slots, positions, cs, **scales)
        assert torch.equal(_bytes(caches[0]), _bytes(caches[1])), num_tokens
        assert_cache_matches_reference(caches[0], caches[2])


def test_single_insert_above_16k_tokens(device) -> None:  # type: ignore[no-untyped-def]
    num_tokens, page = 16384 + 37, 16
    blocks = num_tokens // page + 4
    q, k, v, slots, positions = _inputs(num_tokens, 1, 1, 16, blocks * page, device)
    cs = cos_sin_cache(4096, 16, device)
    caches = [torch.zeros(2, blocks, page, 1, 16, device=device, dtype=torch.float16)]
    caches += [caches[0].clone(), caches[0].clone()]
    insert_qkv(q, k, v, caches[0], slots, positions, cs)
    insert_kv(k, v, caches[1], slots, positions, cs)
    kv_insert_reference(None, k, v, caches[2], slots, positions, cs)
    assert torch.equal(_bytes(caches[0]), _bytes(caches[1]))
    assert_cache_matches_reference(caches[0], caches[2])
    assert int((caches[0][0].abs().sum(-1) > 0).sum()) == int((slots >= 0).sum())


def test_strided_cache_view_uses_its_own_strides(device) -> None:  # type: ignore[no-untyped-def]
    """A cache view with padded blocks: writes land by the view's strides, padding untouched."""
    storage = torch.full((2, 6, 10, 2, 16), 7.0, device=device, dtype=torch.float16)
    cache, ref = storage[:, :, :8], storage.clone()[:, :, :8]
    _, k, v, slots, positions = _inputs(30, 2, 2, 16, 6 * 8, device)
    cs = cos_sin_cache(4096, 16, device)
    insert_kv(k, v, cache, slots, positions, cs, is_neox=False)
    kv_insert_reference(None, k, v, ref, slots, positions, cs, is_neox=False)
    assert torch.equal(cache, ref)
    assert bool((storage[:, :, 8:] == 7.0).all())


def test_without_rope_copies_keys(device) -> None:  # type: ignore[no-untyped-def]
    q, k, v, slots, _ = _inputs(20, 2, 2, 16, 64, device)
    cache = torch.zeros(2, 8, 8, 2, 16, device=device, dtype=torch.float32)
    q_out = insert_qkv(q, k, v, cache, slots, None, None)
    keep = slots >= 0
    assert torch.equal(q_out, q)
    assert torch.equal(cache[0].reshape(64, 2, 16)[slots[keep]], k[keep].float())
    assert torch.equal(cache[1].reshape(64, 2, 16)[slots[keep]], v[keep].float())


def test_rope_reference_styles_agree_on_the_pairing() -> None:
    """gpt-j on interleaved pairs equals neox on the same pairs laid out as halves."""
    x = torch.randn(5, 3, 8)
    pos = torch.arange(5)
    cs = cos_sin_cache(16, 8, torch.device("cpu"))
    halves = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    neox = rope_reference(halves, pos, cs, is_neox=True)
    gptj = rope_reference(x, pos, cs, is_neox=False)
    torch.testing.assert_close(torch.cat([gptj[..., 0::2], gptj[..., 1::2]], -1), neox)
    # Position 0 is the identity rotation.
    torch.testing.assert_close(gptj[0], x[0])
