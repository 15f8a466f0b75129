"""A Mamba2 mixer's weights as the state kernels need them, and the launchers' entry checks.

Channel layout of xBC (the conv input and output, as transformers splits `in_proj`):
`[x: n_heads * head_dim | B: n_groups * d_state | C: n_groups * d_state]`; head h reads the B/C
of group h // (n_heads // n_groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshllm_kernels.runtime.tensor_checks import (
    INDEX_DTYPES,
    MODEL_DTYPES,
    check_shape,
    check_tensor,
)


@dataclass(frozen=True)
class MambaParams:
    """One layer's conv and SSM weights (transformers' Mamba2 mixer names).

    conv_weight `[conv_dim, d_conv]` (the depthwise Conv1d weight squeezed), conv_bias
    `[conv_dim]` or None, dt_bias / A_log / D `[n_heads]`; any model dtype, read as fp32.
    A = -exp(A_log) is computed in fp32. dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)
    (transformers' `time_step_limit`, default (0, inf)).
    """

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    n_groups: int
    head_dim: int
    d_state: int
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def n_heads(self) -> int:
        return self.A_log.shape[0]

    @property
    def d_conv(self) -> int:
        return self.conv_weight.shape[1]

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


def check_params(p: MambaParams, device: torch.device) -> None:
    """Shapes, dtypes and devices of the weights, and the head / group split."""
    if p.n_groups <= 0 or p.head_dim <= 0 or p.d_state <= 0:
        raise ValueError("n_groups, head_dim and d_state must be positive")
    for name in ("dt_bias", "A_log", "D"):
        t = check_tensor(name, getattr(p, name), dtypes=MODEL_DTYPES, ndim=1, device=device,
                         contiguous=True)  # fmt: skip
        check_shape(name, t, (p.n_heads,))
    if p.n_heads % p.n_groups:
        raise ValueError(f"n_heads={p.n_heads} is not a multiple of n_groups={p.n_groups}")
    w = check_tensor("conv_weight", p.conv_weight, dtypes=MODEL_DTYPES, ndim=2, device=device,
                     contiguous=True)  # fmt: skip
    if w.shape[0] != p.conv_dim or not 2 <= w.shape[1] <= 8:
        raise ValueError(
            f"conv_weight has shape {tuple(w.shape)}; expected ({p.conv_dim}, d_conv in 2..8)"
        )
    if p.conv_bias is not None:
        b = check_tensor("conv_bias", p.conv_bias, dtypes=MODEL_DTYPES, ndim=1, device=device,
                         contiguous=True)  # fmt: skip
        check_shape("conv_bias", b, (p.conv_dim,))
    if not (p.dt_min >= 0.0 and p.dt_max >= p.dt_min):
        raise ValueError(f"dt limits must satisfy 0 <= dt_min <= dt_max, got {p.dt_min, p.dt_max}")


def check_pools(p: MambaParams, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
    """The layer's two state pools: contiguous, on the weights' device, sharing num_blocks."""
    device = p.A_log.device
    conv_state = check_tensor("conv_state", conv_state, dtypes=MODEL_DTYPES, ndim=3,
                              device=device, contiguous=True)  # fmt: skip
    ssm_state = check_tensor("ssm_state", ssm_state, dtypes=MODEL_DTYPES, ndim=4, device=device,
                             contiguous=True)  # fmt: skip
    num_blocks = conv_state.shape[0]
    check_shape("conv_state", conv_state, (num_blocks, p.conv_dim, p.d_conv - 1))
    check_shape("ssm_state", ssm_state, (num_blocks, p.n_heads, p.head_dim, p.d_state))


def check_slots(name: str, slots: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """A `[rows]` int32/int64 tensor of block ids (-1: none). Values are not read on the host
    (no sync): ids must be < num_blocks, and no row may write a slot another row reads."""
    slots = check_tensor(name, slots, dtypes=INDEX_DTYPES, ndim=1, device=device, contiguous=True)
    check_shape(name, slots, (rows,))
    return slots
