"""Zeroed int32 counters for kernels whose last program to finish does a final step itself.

A split kernel (today: the split-K decode attention's fused merge,
meshllm_kernels/attention/paged_decode.py) can skip its second, merging launch: each program writes
its partial result, then counts itself done with an acq_rel atomic on its output tile's counter; the
one that brings the count to the number of pieces merges the partials and sets the counter back to
zero for the next launch (or CUDA graph replay). The buffers live here, one per (kernel family,
device), allocated zeroed and never freed. (The same trick for the decode GEMV's split-K reduce was
tried and dropped: inside a CUDA graph it is no faster than the reduce launch.)

Two launches sharing a buffer must not overlap: one stream at a time (a CUDA graph captured
on another stream shares the buffer, which is fine as long as its replays do not run
concurrently with eager launches). A buffer first needed inside a graph capture is not
allocated there: `counters` returns None and the caller uses its second kernel instead (the
worker runs each graph's forward once eagerly before capturing it).
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # kept alive: graphs captured earlier still point at them
MIN_COUNTERS = 1 << 12


def counters(family: str, device: torch.device, n: int) -> torch.Tensor | None:
    """At least n zeroed counters of `family` on `device`, or None inside a graph capture
    that would have to allocate them."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _BUFFERS.get((family, device))
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
        _BUFFERS[(family, device)] = buf
    return buf


def all_zero() -> bool:
    """Every counter of every family back at zero (each merge resets its own)."""
    return all(not buf.any() for buf in _BUFFERS.values())


def allocated(family: str) -> bool:
    return any(key[0] == family for key in _BUFFERS)


def clear() -> None:
    """Forget the buffers (tests)."""
    _BUFFERS.clear()
