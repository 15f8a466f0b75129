"""The shared 1.0 scale that kernels over a 16/32-bit cache take: one tensor per device, never
reallocated (no fill launched per layer), and never allocated for good inside a graph capture."""

from __future__ import annotations

import torch

from meshllm_kernels.attention.paged_cache import CacheGeometry, fp8_scales, unit_scale


def test_one_tensor_per_device_holding_one(device: torch.device) -> None:
    first = unit_scale(device)
    assert first.dtype == torch.float32 and first.shape == (1,) and first.item() == 1.0
    assert unit_scale(device) is first


def test_non_fp8_caches_get_the_shared_scale(device: torch.device) -> None:
    geo = CacheGeometry(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=16, is_fp8=False)
    ks, ks_stride, vs, vs_stride = fp8_scales(geo, None, None, device)
    assert ks is unit_scale(device) and vs is ks and ks_stride == vs_stride == 0
