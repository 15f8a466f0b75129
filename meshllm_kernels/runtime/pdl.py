"""The decode chain's hand-off under programmatic dependent launch (PDL), one helper for every
Triton kernel of the chain.

The chain's kernels (RMSNorm, embedding + RMSNorm, the GEMVs and their split-K reduces, the
attention from the qkv partials) launch with PDL wherever the device has it (`supports_pdl`:
compiled kernels on Hopper and later; elsewhere they launch plainly, the same code with the
hand-off compiled out). Each waits for its predecessor's grid first (griddepcontrol.wait, before
reading anything), then lets its own successor be scheduled (griddepcontrol.launch_dependents),
so the next launch is scheduled while this one runs instead of after its end: the chain is a
few hundred short launches a step, and the gaps between them are what it saves. Waiting before
triggering keeps at most one grid waiting ahead. The sampling kernel after the LM head launches
with PDL too (it only waits: meshllm_kernels/sampling/gumbel_kernel.py)."""

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
