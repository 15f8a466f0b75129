"""Entry checks shared by the kernel launchers, and what the Triton runtime here can do.

A Triton kernel given a wrong dtype, a non-contiguous view or a tensor on another device does
not fail: it reads the wrong bytes. Every launcher therefore checks its inputs first and raises
TypeError (wrong dtype) or ValueError (device, shape, layout) with a message that names the
argument, so a caller's mistake never reaches the GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    The interpreter computes bf16/fp16 dot products wrongly, so kernels take this as a constexpr
    and do their matrix products in fp32 there; on a GPU they stay on the 16-bit tensor cores.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Return `t` as a tensor after checking it, or raise with a message naming `name`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise TypeError(f"{name} has dtype {t.dtype}; expected one of: {names}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the kernel runs on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if last_dim_contiguous and t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (strides {t.stride()})")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {expected}")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def scale_tensor(
    name: str, scale: float | torch.Tensor, num_heads: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """An fp8 dequantization scale as (fp32 tensor, stride per kv head).

    Per-tensor scales get stride 0, per-head scales (one per kv head) stride 1, so one kernel
    serves both. A Python float becomes a fresh device tensor (a host->device copy: pass
    tensors on hot paths and inside CUDA graphs).
    """
    if isinstance(scale, (int, float)):
        if not scale > 0:
            raise ValueError(f"{name} must be positive, got {scale}")
        return torch.tensor([float(scale)], dtype=torch.float32, device=device), 0
    scale = check_tensor(name, scale, dtypes=(torch.float32,), device=device)
    if scale.numel() == 1:
        return scale.reshape(1), 0
    if scale.dim() != 1 or scale.numel() != num_heads or not scale.is_contiguous():
        raise ValueError(
            f"{name} must be a scalar or a contiguous [num_kv_heads={num_heads}] tensor, "
            f"got shape {tuple(scale.shape)}"
        )
    return scale, 1


def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels on Hopper (sm_90) and later."""
    return device.type == "cuda" and not interpreting() and _properties(device).major >= 9


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 stands in for any other device)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else 4


def _properties(device: torch.device) -> torch.cuda._CudaDeviceProperties:
    """The device's properties, looked up once: kernel launchers ask at every launch, and
    torch's lookup is slow enough to add up over the launches of an eager step."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _properties_of(index)


@functools.cache
def _properties_of(index: int) -> torch.cuda._CudaDeviceProperties:
    return torch.cuda.get_device_properties(index)


def pdl_launch(use: bool) -> dict[str, bool]:
    """Launch keywords of a kernel that takes part in a PDL chain
    (meshllm_kernels/runtime/pdl.py)."""
    return {"launch_pdl": True} if use else {}
