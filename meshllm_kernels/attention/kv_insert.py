"""Write new tokens' K/V into the paged cache with fused RoPE and optional fp8 quantization.

One kernel, two variants chosen by the constexpr NUM_Q_HEADS: the Q+KV variant also rotates
the queries (returned as a new tensor), the KV-only variant (NUM_Q_HEADS = 0) has no query
programs at all. A kv head's program runs the same instructions in both, so the cache bytes
are identical: RoPE rounding and fp8 rounding cannot drift between a forward pass and a
context-only insert (prefix loading, draft context) of the same tokens.

Rotation is in fp32: neox style rotates the halves (x[:r/2], x[r/2:r]), gpt-j style the
interleaved pairs (x[2i], x[2i+1]); dims past the rotary width r pass through. The kernel is
compiled without FMA contraction, so each product and difference rounds as in the PyTorch
reference and a GPU insert writes the same bytes as the CPU path. cos/sin come
from a cache [max_position, r] holding cos in its first half and sin in its second, indexed by
each token's position. fp8 e4m3: x / scale (correctly rounded), clamped to +-448.

Addresses use the cache tensor's own strides (block, slot, head) and int64 slots, so a cache
larger than 2^31 elements or with padded blocks is written correctly. slot < 0 skips a token
(padding). Tokens are cut into tiles of BLOCK_T; at most `max_tile_programs` programs run per
head and loop over the remaining tiles, so any token count launches the same grid shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.attention.paged_cache import check_kv_cache, unit_scale
from meshllm_kernels.runtime.tensor_checks import (
    FP8_E4M3,
    FP8_E4M3_MAX,
    INDEX_DTYPES,
    MODEL_DTYPES,
    check_shape,
    check_tensor,
    interpreting,
    next_power_of_2,
    scale_tensor,
)

DEFAULT_MAX_TILE_PROGRAMS = 4096


def tokens_per_tile() -> int:
    """Tokens one program handles per loop step (the grid is tiles x heads, tiles capped)."""
    return 32 if interpreting() else 16


@triton.jit
def to_cache(x, scale, FP8: tl.constexpr, dtype: tl.constexpr):
    if FP8:
        x = tl.math.div_rn(x, scale)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x.to(dtype)


@triton.jit
def _rope_store(
    src_ptrs,
    dst_ptrs,
    cos,
    sin,
    mask,
    scale,
    offs_h,
    offs_p,
    ROT_HALF: tl.constexpr,
    PASS_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    FP8: tl.constexpr,
    dtype: tl.constexpr,
):
    """Rotate rows [BLOCK_T] x head_dim at src_ptrs (row bases) and store them at dst_ptrs."""
    if ROT_HALF > 0:
        if IS_NEOX:
            i1 = offs_h
            i2 = offs_h + ROT_HALF
        else:
            i1 = 2 * offs_h
            i2 = 2 * offs_h + 1
        h_mask = mask[:, None] & (offs_h < ROT_HALF)[None, :]
        x1 = tl.load(src_ptrs[:, None] + i1[None, :], mask=h_mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptrs[:, None] + i2[None, :], mask=h_mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(dst_ptrs[:, None] + i1[None, :], to_cache(o1, scale, FP8, dtype), mask=h_mask)
        tl.store(dst_ptrs[:, None] + i2[None, :], to_cache(o2, scale, FP8, dtype), mask=h_mask)
    if PASS_DIM > 0:
        ip = 2 * ROT_HALF + offs_p
        p_mask = mask[:, None] & (offs_p < PASS_DIM)[None, :]
        xp = tl.load(src_ptrs[:, None] + ip[None, :], mask=p_mask, other=0.0).to(tl.float32)
        tl.store(dst_ptrs[:, None] + ip[None, :], to_cache(xp, scale, FP8, dtype), mask=p_mask)


# num_tokens is not specialized: Triton would otherwise compile separate variants for 1 and
# for multiples of 16 tokens, i.e. recompile mid-serving as batch sizes change.
@triton.jit(do_not_specialize=["num_tokens"])
def _kv_insert_kernel(
    q_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    positions_ptr,
    slots_ptr,
    cos_sin_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_kv,
    stride_block,
    stride_slot,
    stride_head,
    k_scale_stride,
    v_scale_stride,
    NUM_Q_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS_DIM: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    IS_NEOX: tl.constexpr,
    FP8: tl.constexpr,
):
    head = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_HALF)
    offs_p = tl.arange(0, BLOCK_PASS)
    num_tiles = tl.cdiv(num_tokens, BLOCK_T)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        t_valid = offs_t < num_tokens
        rows = offs_t.to(tl.int64)
        cos = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32)
        sin = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32)
        if ROT_HALF > 0:
            pos = tl.load(positions_ptr + rows, mask=t_valid, other=0).to(tl.int64)
            cs = cos_sin_ptr + pos[:, None] * stride_cs + offs_h[None, :]
            cs_mask = t_valid[:, None] & (offs_h < ROT_HALF)[None, :]
            cos = tl.load(cs, mask=cs_mask, other=0.0).to(tl.float32)
            sin = tl.load(cs + ROT_HALF, mask=cs_mask, other=0.0).to(tl.float32)
        # Names differ between the branches: Triton requires a variable assigned in both
        # branches of a run-time `if` to have one type, and q_out and the cache may not.
        if head < NUM_Q_HEADS:
            q_src = q_ptr + rows * stride_qt + head * stride_qh
            q_dst = q_out_ptr + rows * stride_qot + head * stride_qoh
            _rope_store(
                q_src, q_dst, cos, sin, t_valid, 1.0, offs_h, offs_p,
                ROT_HALF, PASS_DIM, IS_NEOX, False, q_out_ptr.dtype.element_ty,
            )  # fmt: skip
        else:
            kv_head = head - NUM_Q_HEADS
            slot = tl.load(slots_ptr + rows, mask=t_valid, other=-1)
            write = t_valid & (slot >= 0)
            slot = tl.where(write, slot, 0)
            kv_dst = cache_ptr + (
                (slot // PAGE) * stride_block + (slot % PAGE) * stride_slot + kv_head * stride_head
            )
            k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride)
            v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride)
            cache_dtype = cache_ptr.dtype.element_ty
            _rope_store(
                k_ptr + rows * stride_kt + kv_head * stride_kh, kv_dst, cos, sin, write, k_scale,
                offs_h, offs_p, ROT_HALF, PASS_DIM, IS_NEOX, FP8, cache_dtype,
            )  # fmt: skip
            # V is not rotated: all of it goes through the pass-through path.
            _rope_store(
                v_ptr + rows * stride_vt + kv_head * stride_vh, kv_dst + stride_kv, cos, sin,
                write, v_scale, offs_h, tl.arange(0, BLOCK_D),
                0, HEAD_DIM, IS_NEOX, FP8, cache_dtype,
            )  # fmt: skip


def _check_heads(name: str, t: object, num_tokens: int | None, head_dim: int) -> torch.Tensor:
    x = check_tensor(name, t, dtypes=MODEL_DTYPES, ndim=3, last_dim_contiguous=True)
    if x.shape[2] != head_dim:
        raise ValueError(f"{name} head_dim {x.shape[2]} != kv_cache head_dim {head_dim}")
    if num_tokens is not None and x.shape[0] != num_tokens:
        raise ValueError(f"{name} has {x.shape[0]} tokens; key has {num_tokens}")
    return x


def _launch(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    is_neox: bool,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    max_tile_programs: int,
) -> torch.Tensor | None:
    geo = check_kv_cache(kv_cache)
    device = kv_cache.device
    key = _check_heads("key", key, None, geo.head_dim)
    num_tokens = key.shape[0]
    value = _check_heads("value", value, num_tokens, geo.head_dim)
    for name, t in (("key", key), ("value", value)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {device}")
        if t.shape[1] != geo.num_kv_heads:
            raise ValueError(f"{name} has {t.shape[1]} heads; kv_cache has {geo.num_kv_heads}")
    slots = check_tensor(
        "slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=1, device=device,
        contiguous=True,
    )  # fmt: skip
    check_shape("slot_mapping", slots, (num_tokens,))
    if query is not None:
        query = _check_heads("query", query, num_tokens, geo.head_dim)
        if query.device != device:
            raise ValueError(f"query is on {query.device} but kv_cache is on {device}")
    rot_half = 0
    if cos_sin_cache is not None:
        cos_sin_cache = check_tensor(
            "cos_sin_cache", cos_sin_cache, dtypes=MODEL_DTYPES, ndim=2, device=device,
            last_dim_contiguous=True,
        )  # fmt: skip
        rotary_dim = cos_sin_cache.shape[1]
        if rotary_dim % 2 or not 0 < rotary_dim <= geo.head_dim:
            raise ValueError(
                f"cos_sin_cache width {rotary_dim} must be even and in 1..{geo.head_dim}"
            )
        positions = check_tensor(
            "positions", positions, dtypes=INDEX_DTYPES, ndim=1, device=device, contiguous=True
        )
        check_shape("positions", positions, (num_tokens,))
        if device.type == "cpu" and num_tokens:
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= cos_sin_cache.shape[0]:
                raise ValueError(
                    f"positions must lie in 0..{cos_sin_cache.shape[0] - 1}, got {lo}..{hi}"
                )
        rot_half = rotary_dim // 2
    if geo.is_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 kv_cache needs k_scale and v_scale to quantize with")
        ks, ks_stride = scale_tensor("k_scale", k_scale, geo.num_kv_heads, device)
        vs, vs_stride = scale_tensor("v_scale", v_scale, geo.num_kv_heads, device)
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale/v_scale are only for an fp8 kv_cache")
    else:
        ks = vs = unit_scale(device)
        ks_stride = vs_stride = 0
    if max_tile_programs < 1:
        raise ValueError(f"max_tile_programs must be >= 1, got {max_tile_programs}")

    q_out = torch.empty_like(query) if query is not None else None
    num_q_heads = query.shape[1] if query is not None else 0
    if num_tokens == 0:
        return q_out
    q_arg = query if query is not None else key
    qo_arg = q_out if q_out is not None else key
    block_t = tokens_per_tile()
    pass_dim = geo.head_dim - 2 * rot_half
    num_programs = min(triton.cdiv(num_tokens, block_t), max_tile_programs)
    grid = (num_programs, num_q_heads + geo.num_kv_heads)
    _kv_insert_kernel[grid](
        q_arg, qo_arg, key, value, kv_cache, positions if positions is not None else slots,
        slots, cos_sin_cache if cos_sin_cache is not None else ks, ks, vs, num_tokens,
        q_arg.stride(0), q_arg.stride(1), qo_arg.stride(0), qo_arg.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0) if cos_sin_cache is not None else 0,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        ks_stride, vs_stride,
        NUM_Q_HEADS=num_q_heads, PAGE=geo.block_size, HEAD_DIM=geo.head_dim,
        BLOCK_D=next_power_of_2(geo.head_dim), ROT_HALF=rot_half,
        BLOCK_HALF=next_power_of_2(max(rot_half, 1)), PASS_DIM=pass_dim,
        BLOCK_PASS=next_power_of_2(max(pass_dim, 1)), BLOCK_T=block_t, IS_NEOX=bool(is_neox),
        FP8=geo.is_fp8, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out


def insert_qkv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    *,
    is_neox: bool = True,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_tile_programs: int = DEFAULT_MAX_TILE_PROGRAMS,
) -> torch.Tensor:
    """Rotate Q and K, write K/V at slot_mapping; returns the rotated queries [T, Hq, D]."""
    if query is None:
        raise ValueError("insert_qkv needs a query tensor; use insert_kv for context-only KV")
    q_out = _launch(
        query, key, value, kv_cache, slot_mapping, positions, cos_sin_cache, is_neox,
        k_scale, v_scale, max_tile_programs,
    )  # fmt: skip
    assert q_out is not None
    return q_out


def insert_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    *,
    is_neox: bool = True,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    max_tile_programs: int = DEFAULT_MAX_TILE_PROGRAMS,
) -> None:
    """The KV-only variant: the same kernel with zero query heads."""
    _launch(
        None, key, value, kv_cache, slot_mapping, positions, cos_sin_cache, is_neox,
        k_scale, v_scale, max_tile_programs,
    )  # fmt: skip


def rope_reference(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """RoPE in fp32 on [T, H, D]; returns fp32."""
    x = x.float()
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    out = x.clone()
    if is_neox:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half : 2 * half] = x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = x1 * cos - x2 * sin
        out[..., 1 : 2 * half : 2] = x2 * cos + x1 * sin
    return out


def quantize_reference(
    x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor | None
) -> torch.Tensor:
    """fp32 [T, H, D] to the cache dtype; fp8 divides by the (per-tensor or per-head) scale."""
    if dtype != FP8_E4M3:
        return x.to(dtype)
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(-1)
    s = s.reshape(1, -1, 1) if s.numel() > 1 else s.reshape(1, 1, 1)
    return (x / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def kv_insert_reference(
    query: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    *,
    is_neox: bool = True,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The same insert in PyTorch (writes kv_cache in place); returns rotated Q or None."""
    if cos_sin_cache is not None:
        assert positions is not None
        k = rope_reference(key, positions, cos_sin_cache, is_neox)
        q = rope_reference(query, positions, cos_sin_cache, is_neox) if query is not None else None
    else:
        k, q = key.float(), query.float() if query is not None else None
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = quantize_reference(k[keep], kv_cache.dtype, k_scale)
    kv_cache[1, blocks, offsets] = quantize_reference(value.float()[keep], kv_cache.dtype, v_scale)
    return q.to(query.dtype) if q is not None and query is not None else None
