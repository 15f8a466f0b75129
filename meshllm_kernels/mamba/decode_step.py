"""One decode token per request: the Mamba2 conv-state shift + conv + SiLU, then the SSM step.

    y = mamba_decode_step(xBC, dt, params, conv_state, ssm_state, read_slot, write_slot)

xBC `[B, conv_dim]` (the new pre-conv column from in_proj, model dtype), dt `[B, n_heads]`
(raw, before dt_bias/softplus), conv_state `[num_blocks, conv_dim, d_conv - 1]` and ssm_state
`[num_blocks, n_heads, head_dim, d_state]` pools (any model dtype each; states are computed in
fp32 and rounded to the pool's dtype when stored), read_slot / write_slot `[B]` int32/int64:
row b reads its states from read_slot[b] (-1: zero states) and writes the new ones to
write_slot[b] (-1: writes nothing, e.g. pad rows; may equal read_slot[b]). Returns y
`[B, n_heads, head_dim]` in out_dtype (default xBC's dtype): C . S' + D * x, without the z gate
(the caller's gated RMSNorm applies it). The conv output is rounded to xBC's dtype before the
SSM reads it (as transformers does). Math and rounding: meshllm_kernels/mamba/reference.py.

Two launches (conv, then the SSM step), no host synchronisation and no host loops over rows:
the step can be captured in a CUDA graph with fixed B (pad rows with -1 slots).
"""

from __future__ import annotations

import torch

from meshllm_kernels.mamba.conv_kernel import causal_conv
from meshllm_kernels.mamba.params import MambaParams, check_params, check_pools, check_slots
from meshllm_kernels.mamba.scan_kernel import ssm_scan
from meshllm_kernels.runtime.tensor_checks import MODEL_DTYPES, check_shape, check_tensor


def check_tokens(
    xBC: torch.Tensor, dt: torch.Tensor, p: MambaParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """xBC [T, conv_dim] and dt [T, n_heads] on the weights' device, last dims contiguous."""
    device = p.A_log.device
    xBC = check_tensor("xBC", xBC, dtypes=MODEL_DTYPES, ndim=2, device=device,
                       last_dim_contiguous=True)  # fmt: skip
    check_shape("xBC", xBC, (xBC.shape[0], p.conv_dim))
    dt = check_tensor("dt", dt, dtypes=MODEL_DTYPES, ndim=2, device=device,
                      last_dim_contiguous=True)  # fmt: skip
    check_shape("dt", dt, (xBC.shape[0], p.n_heads))
    return xBC, dt


def mamba_decode_step(
    xBC: torch.Tensor,
    dt: torch.Tensor,
    p: MambaParams,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One Mamba2 step for each of B rows (module docstring); returns y [B, n_heads, head_dim].
    Rows must not write a slot another row reads."""
    check_params(p, p.A_log.device)
    xBC, dt = check_tokens(xBC, dt, p)
    check_pools(p, conv_state, ssm_state)
    rows = xBC.shape[0]
    read_slot = check_slots("read_slot", read_slot, rows, xBC.device)
    write_slot = check_slots("write_slot", write_slot, rows, xBC.device)
    xbc = causal_conv(xBC, p.conv_weight, p.conv_bias, conv_state, None, read_slot, write_slot,
                      None)  # fmt: skip
    return ssm_scan(xbc, dt, p, ssm_state, None, read_slot, write_slot, None,
                    out_dtype or xBC.dtype)  # fmt: skip
