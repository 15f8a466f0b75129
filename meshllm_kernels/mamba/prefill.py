"""Varlen Mamba2 prefill: packed tokens of several requests through the conv and the scan,
with the states at block boundaries kept for prefix caching.

    y = mamba_prefill(xBC, dt, cu_seqlens, params, conv_state, ssm_state, read_slot,
                      write_slot, state_cu, state_offsets, state_slots)

xBC `[T, conv_dim]` and dt `[T, n_heads]` hold the requests' tokens back to back, request r at
rows cu_seqlens[r] .. cu_seqlens[r + 1] - 1 (cu_seqlens `[R + 1]` int32, cu_seqlens[0] = 0;
empty spans allowed). Request r starts from the conv and SSM states of block read_slot[r]
(-1: zeros), continues the causal conv from that conv state, and writes its final states to
write_slot[r] (-1: nowhere; may equal read_slot[r]). Boundary states: state_cu `[R + 1]` int32
indexes state_offsets / state_slots `[K]`: request r's entries state_cu[r] .. state_cu[r+1]-1
are (token count o from the span's start, 1 <= o <= length, strictly increasing; block id):
the conv and SSM states after the span's first o tokens go to that block (-1: skipped). Slots
written by one request must differ from every slot read in the launch, except a request's own
final write slot, which may be its read slot. Pools and rounding as in decode_step; y
`[T, n_heads, head_dim]` (out_dtype, default xBC's dtype) for every token.

Scan: chunk_size (a power of two >= 16, default 64) selects the chunked SSD form
(chunk_scan_kernel.py: intra-chunk quadratic form + state passing, chunks also cut at the
boundaries); chunk_size=None the sequential-over-time recurrence (scan_kernel.py), which the
decode step uses. Both walk one request per program (x heads x head_dim tiles). No host
synchronisation: cu_seqlens and the boundaries are read on the device.
"""

from __future__ import annotations

import torch

from meshllm_kernels.mamba.chunk_scan_kernel import ssd_chunk_scan
from meshllm_kernels.mamba.conv_kernel import causal_conv
from meshllm_kernels.mamba.decode_step import check_tokens
from meshllm_kernels.mamba.params import MambaParams, check_params, check_pools, check_slots
from meshllm_kernels.mamba.scan_kernel import ssm_scan
from meshllm_kernels.runtime.tensor_checks import check_tensor

DEFAULT_CHUNK_SIZE = 64


def check_bounds(
    rows: int,
    state_cu: torch.Tensor | None,
    state_offsets: torch.Tensor | None,
    state_slots: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The boundary CSR (all three or none), or None when there are no boundaries."""
    given = [t is not None for t in (state_cu, state_offsets, state_slots)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("state_cu, state_offsets and state_slots go together")
    state_cu = check_tensor("state_cu", state_cu, dtypes=(torch.int32,), ndim=1, device=device,
                            contiguous=True)  # fmt: skip
    if state_cu.shape[0] != rows + 1:
        raise ValueError(f"state_cu has shape {tuple(state_cu.shape)}; expected ({rows + 1},)")
    state_offsets = check_tensor("state_offsets", state_offsets, dtypes=(torch.int32,), ndim=1,
                                 device=device, contiguous=True)  # fmt: skip
    state_slots = check_slots("state_slots", state_slots, state_offsets.shape[0], device)
    return state_cu, state_offsets, state_slots


def mamba_prefill(
    xBC: torch.Tensor,
    dt: torch.Tensor,
    cu_seqlens: torch.Tensor,
    p: MambaParams,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    state_cu: torch.Tensor | None = None,
    state_offsets: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Prefill R packed requests (module docstring); returns y [T, n_heads, head_dim]."""
    check_params(p, p.A_log.device)
    xBC, dt = check_tokens(xBC, dt, p)
    check_pools(p, conv_state, ssm_state)
    device = xBC.device
    cu_seqlens = check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32,), ndim=1,
                              device=device, contiguous=True)  # fmt: skip
    rows = cu_seqlens.shape[0] - 1
    if rows < 0:
        raise ValueError("cu_seqlens must have at least one entry")
    read_slot = check_slots("read_slot", read_slot, rows, device)
    write_slot = check_slots("write_slot", write_slot, rows, device)
    bounds = check_bounds(rows, state_cu, state_offsets, state_slots, device)
    xbc = causal_conv(xBC, p.conv_weight, p.conv_bias, conv_state, cu_seqlens, read_slot,
                      write_slot, bounds)  # fmt: skip
    out_dtype = out_dtype or xBC.dtype
    if chunk_size is None:
        return ssm_scan(xbc, dt, p, ssm_state, cu_seqlens, read_slot, write_slot, bounds,
                        out_dtype)  # fmt: skip
    return ssd_chunk_scan(xbc, dt, p, ssm_state, cu_seqlens, read_slot, write_slot, bounds,
                          out_dtype, chunk_size)  # fmt: skip
