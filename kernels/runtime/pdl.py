"""The decode chain's hand-off under programmatic dependent launch (PDL), one helper for every
Triton kernel of the chain (tensor_checks.CHAIN_PDL_DEFAULT says why the chain runs this way)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chain_handoff(PDL: tl.constexpr):
    """Wait for the predecessor's grid (nothing it writes is read before this), then let the
    successor be scheduled: waiting first keeps at most one grid waiting ahead. A no-op
    outside a PDL chain."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
