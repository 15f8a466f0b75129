"""The worker's paged KV cache layout, checked once for every kernel that reads or writes it.

Per layer the cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]`, K at [0] and V
at [1]; token slot s lives in block s // block_size at offset s % block_size. Kernels address it
through the tensor's own strides, so a cache that is a view into a larger allocation (padded
block stride, K and V planes apart) works as long as each token's record (all kv heads of one
token) is contiguous. Block tables are int32 [num_seqs, max_blocks] of physical block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshllm_kernels.runtime.tensor_checks import FP8_E4M3, check_tensor, scale_tensor

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_E4M3)


@dataclass(frozen=True)
class CacheGeometry:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    is_fp8: bool


def check_kv_cache(kv_cache: object, device: torch.device | None = None) -> CacheGeometry:
    """Check the cache's dtype and record layout; return its geometry."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dtype not in CACHE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in CACHE_DTYPES)
        raise TypeError(f"unsupported kv_cache dtype {kv_cache.dtype}; supported: {names}")
    cache = check_tensor("kv_cache", kv_cache, ndim=5, device=device)
    if cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] "
            f"(K and V planes), got shape {tuple(cache.shape)}"
        )
    _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    if cache.stride(4) != 1 or cache.stride(3) != head_dim:
        raise ValueError(
            "kv_cache token records must be contiguous (head_dim stride 1, kv-head stride "
            f"head_dim); got strides {cache.stride()}"
        )
    if min(num_blocks, block_size, num_kv_heads, head_dim) <= 0:
        raise ValueError(f"kv_cache has an empty dimension: shape {tuple(cache.shape)}")
    return CacheGeometry(num_blocks, block_size, num_kv_heads, head_dim, cache.dtype == FP8_E4M3)


def fp8_scales(
    geometry: CacheGeometry,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, int, torch.Tensor, int]:
    """Scales as kernel arguments: (k tensor, k stride, v tensor, v stride).

    An fp8 cache without scales is an error: dequantizing with an implied 1.0 silently gives
    wrong attention when the writer used a scale. A 16/32-bit cache refuses scales too: a caller
    passing them has mixed up its layers' cache specs.
    """
    if geometry.is_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 kv_cache needs k_scale and v_scale")
        k, ks = scale_tensor("k_scale", k_scale, geometry.num_kv_heads, device)
        v, vs = scale_tensor("v_scale", v_scale, geometry.num_kv_heads, device)
        return k, ks, v, vs
    if k_scale is not None or v_scale is not None:
        raise ValueError("k_scale/v_scale are only for an fp8 kv_cache")
    one = unit_scale(device)
    return one, 0, one, 0


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def unit_scale(device: torch.device) -> torch.Tensor:
    """A [1] fp32 tensor holding 1.0 on `device`: the scale argument of kernels over a 16/32-bit
    cache. Allocated once per device and never written, so a decode step does not launch a fill
    for it per layer (two a layer in a CUDA graph before: 64 launches a Llama-3-8B step). Inside
    a graph capture that would have to allocate it, a fresh one (its fill captured with it)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    one = _UNIT_SCALES.get(device)
    if one is None:
        one = torch.ones(1, dtype=torch.float32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return one
        _UNIT_SCALES[device] = one
    return one


def check_block_tables(block_tables: object, num_seqs: int, device: torch.device) -> torch.Tensor:
    tables = check_tensor(
        "block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=device
    )
    if tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {tables.shape[0]} rows for {num_seqs} sequences")
    if tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    return tables


def check_seq_lens(seq_lens: object, num_seqs: int, device: torch.device) -> torch.Tensor:
    lens = check_tensor(
        "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=device, contiguous=True
    )
    if lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {lens.shape[0]} entries for {num_seqs} sequences")
    return lens


def check_window(sliding_window: int | None) -> int:
    """0 means no window; a window must be a positive number of keys."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    return sliding_window


def dequantized_scale(scale: float | torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """A scale broadcastable over [tokens, kv_heads, head_dim] (1.0 when absent)."""
    if scale is None:
        return torch.ones(1, 1, 1)
    s = torch.as_tensor(scale, dtype=torch.float32).detach().cpu().reshape(-1)
    per_head = s.numel() == num_kv_heads and s.numel() > 1
    return s.reshape(1, -1, 1) if per_head else s.reshape(1, 1, 1)


def gather_sequence_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference read of one sequence's first `seq_len` keys and values, fp32 [L, Hkv, D]."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table.long()[positions // block_size]
    offsets = positions % block_size
    k = kv_cache[0, blocks, offsets].float()
    v = kv_cache[1, blocks, offsets].float()
    if kv_cache.dtype == FP8_E4M3:
        k = k * dequantized_scale(k_scale, num_kv_heads).to(k.device)
        v = v * dequantized_scale(v_scale, num_kv_heads).to(v.device)
    return k, v
