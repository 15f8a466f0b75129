"""The decode chain's first kernel: token feed, embedding lookup and the first RMSNorm in one.

A batch-1 decode graph began with three launches before its first GEMV: the token feed
(meshllm_kernels/decode_chain/token_feed.py), the embedding gather and the first layer's input
RMSNorm. Here one program per row resolves its id (an id -(row + 1) stands for latest[row], a token
the host does not have yet), copies the embedding row out (the residual stream) and normalizes it,
with the rounding of meshllm_kernels/layers/rmsnorm.py (bit-identical to the three launches: an
embedding row is already in the activation dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.layers.rmsnorm import (
    MAX_HIDDEN,
    add_rmsnorm_row,
    check_norm_inputs,
    norm_warps,
)
from meshllm_kernels.runtime.pdl import chain_handoff
from meshllm_kernels.runtime.tensor_checks import (
    MODEL_DTYPES,
    check_tensor,
    next_power_of_2,
    pdl_launch,
    supports_pdl,
)


@triton.jit
def _embed_rmsnorm_kernel(
    ids_ptr,
    latest_ptr,
    table_ptr,
    weight_ptr,
    stream_ptr,
    out_ptr,
    eps,
    hidden,
    stride_table,
    FED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    chain_handoff(PDL)
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + row)
    # Two ifs: the first is resolved at compile time, the second per row.
    if FED:  # noqa: SIM102
        if token < 0:
            token = tl.load(latest_ptr + (-token - 1))
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(table_ptr + token.to(tl.int64) * stride_table + offs, mask=mask, other=0.0)
    tl.store(stream_ptr + row * hidden + offs, x, mask=mask)
    add_rmsnorm_row(
        x.to(tl.float32), stream_ptr, weight_ptr, out_ptr + row * hidden, stream_ptr, offs,
        mask, eps, hidden, False,
    )  # fmt: skip


def embed_rmsnorm(
    ids: torch.Tensor,
    table: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    latest: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, stream) [T, hidden] for ids [T] int64: stream = table[ids] and normed its
    RMSNorm times weight. With `latest` (int64 [R]), an id -(row + 1) reads latest[row] first.
    Ids and rows are not range-checked (a host sync): the runner checks them where they enter.
    Launched in the decode step's PDL chain where the device supports it."""
    ids = check_tensor("ids", ids, dtypes=(torch.int64,), ndim=1, contiguous=True)
    device = ids.device
    table = check_tensor(
        "table", table, dtypes=MODEL_DTYPES, ndim=2, device=device, last_dim_contiguous=True
    )
    num_rows, hidden = ids.shape[0], table.shape[1]
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in 1..{MAX_HIDDEN}, got {hidden}")
    _, weight = check_norm_inputs(table, (num_rows, hidden), weight, eps, None)
    if latest is not None:
        check_tensor(
            "latest", latest, dtypes=(torch.int64,), ndim=1, device=device, contiguous=True
        )
    stream = torch.empty(num_rows, hidden, dtype=table.dtype, device=device)
    out = torch.empty_like(stream)
    if num_rows == 0:
        return out, stream
    block = next_power_of_2(hidden)
    use_pdl = supports_pdl(device)
    _embed_rmsnorm_kernel[(num_rows,)](
        ids, latest if latest is not None else ids, table, weight, stream, out, float(eps),
        hidden, table.stride(0), FED=latest is not None, BLOCK=block, PDL=use_pdl,
        num_warps=norm_warps(block), **pdl_launch(use_pdl),
    )  # fmt: skip
    return out, stream
