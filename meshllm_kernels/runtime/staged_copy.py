"""Host->device copies staged through pinned memory (CONTRACTS: "Host->device copies").

`copy_(non_blocking=True)` from pageable host memory is silently synchronous, so every hot-path
upload goes host -> pinned staging -> device, asynchronously. The hazard of an asynchronous
copy is reuse: if the host writes the staging memory again before the DMA engine has read it,
the device receives the new bytes. Two ways out, one per helper here:

- `CpuGpuBuffer` (persistent, per-step inputs such as positions or slot mappings): a paired
  pinned host tensor and device tensor. `copy_to_gpu(n)` records an event after the copy; the
  next access to `.cpu` waits for that event, so the host can never overwrite bytes that are
  still in flight. On a CPU-only machine the pair degrades to a plain copy between two CPU
  tensors and there is nothing to wait for.
- `stage_to_device(src, device)` (one-off uploads): a fresh pinned buffer per call. PyTorch's
  pinned-memory allocator records the copy's stream on the block and does not hand it out
  again until the copy has finished, so no event is needed here.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class CopyFence(Protocol):
    """What the buffer needs from a CUDA event: mark the copy, wait for it."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


def _pinnable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


class CpuGpuBuffer:
    """A host staging tensor paired with a device tensor of the same shape and dtype.

    Invariant: between `copy_to_gpu` and the completion of that copy, `.cpu` is not handed
    out; the host side of an in-flight copy is never writable.
    """

    def __init__(
        self,
        *size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fence: CopyFence | None = None,
    ) -> None:
        self.device = torch.device(device)
        pinned = _pinnable(self.device)
        self._cpu = torch.zeros(*size, dtype=dtype, pin_memory=pinned)
        self.gpu = torch.zeros(*size, dtype=dtype, device=self.device)
        if fence is None and pinned:
            fence = torch.cuda.Event()
        self._fence = fence
        self._in_flight = False

    @property
    def cpu(self) -> torch.Tensor:
        """The host tensor, safe to write: waits for the previous copy to finish reading it."""
        self.wait()
        return self._cpu

    @property
    def np(self) -> np.ndarray:
        return self.cpu.numpy()

    def wait(self) -> None:
        if self._in_flight and self._fence is not None:
            self._fence.synchronize()
        self._in_flight = False

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first n rows (all when None) to the device; returns that device slice."""
        rows = self._cpu.shape[0] if self._cpu.dim() else 1
        if n is None:
            n = rows
        if not 0 <= n <= rows:
            raise ValueError(f"copy_to_gpu(n={n}) outside the buffer's {rows} rows")
        if self._cpu.dim() == 0:
            self.gpu.copy_(self._cpu, non_blocking=True)
            dst = self.gpu
        else:
            dst = self.gpu[:n]
            dst.copy_(self._cpu[:n], non_blocking=True)
        if self._fence is not None:
            self._fence.record()
            self._in_flight = True
        return dst


def stage_to_device(src: torch.Tensor | np.ndarray, device: torch.device | str) -> torch.Tensor:
    """Upload `src` asynchronously through a fresh pinned buffer (a plain copy without CUDA)."""
    device = torch.device(device)
    host = torch.from_numpy(np.ascontiguousarray(src)) if isinstance(src, np.ndarray) else src
    if not isinstance(host, torch.Tensor):
        raise TypeError(f"stage_to_device takes a tensor or ndarray, got {type(src).__name__}")
    if host.device.type != "cpu":
        raise ValueError(f"stage_to_device copies from host memory; src is on {host.device}")
    if not _pinnable(device):
        return host.to(device, copy=True)
    staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staging.copy_(host)
    return staging.to(device, non_blocking=True)


class PackedCpuGpuBuffer:
    """Several per-step input arrays in one `CpuGpuBuffer` of bytes, uploaded with one copy.

    A decode step has five small inputs (token ids, positions, KV slots, sequence lengths,
    block tables); five copies cost five DMA launches and the gaps between them, which at
    batch 1 are a visible part of a step. Here each field is a typed view into one pinned host
    allocation and one device allocation, laid out in the given order (each 16-byte aligned), and
    `copy_to_gpu(upto)` uploads the prefix of bytes that ends with the rows a step needs, so
    list the field whose size grows with the rows needed last. The buffer's fence rule holds
    for every field at once: `host()` waits for the copy still reading the host bytes.
    """

    ALIGN = 16

    def __init__(
        self,
        fields: dict[str, tuple[tuple[int, ...], torch.dtype]],
        *,
        device: torch.device | str,
        fence: CopyFence | None = None,
    ) -> None:
        self._layout: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        offset = 0
        for name, (shape, dtype) in fields.items():
            offset = -(-offset // self.ALIGN) * self.ALIGN
            self._layout[name] = (offset, shape, dtype)
            offset = self.end(name, shape[0])
        self._bytes = CpuGpuBuffer(max(offset, 1), dtype=torch.uint8, device=device, fence=fence)
        self.gpu = {name: self._view(self._bytes.gpu, name) for name in self._layout}
        # The host views, made once: five torch views and `.numpy()` calls cost ~90 us a step
        # on the H100 machine's host (measured 2026-12-05), more than the upload itself.
        raw = self._bytes.cpu
        self._host = {name: self._view(raw, name).numpy() for name in self._layout}

    def _view(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        offset, shape, dtype = self._layout[name]
        return raw[offset : self.end(name, shape[0])].view(dtype).view(shape)

    def host(self) -> dict[str, np.ndarray]:
        """Every field's host array, safe to write (waits for the previous copy once). The
        same arrays every call: write into them, do not keep the dict's entries replaced."""
        self._bytes.wait()
        return self._host

    def end(self, name: str, rows: int) -> int:
        """Byte offset just past the first `rows` rows of field `name`."""
        offset, shape, dtype = self._layout[name]
        if not 0 <= rows <= shape[0]:
            raise ValueError(f"{name} has {shape[0]} rows, not {rows}")
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        return offset + rows * row_bytes

    def copy_to_gpu(self, upto: int) -> None:
        """Upload bytes [0, upto) (see `end`) in one copy."""
        self._bytes.copy_to_gpu(upto)
