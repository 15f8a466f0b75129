"""Token ids fed on the device, inside a decode graph.

With asynchronous scheduling step N+1 is launched before step N's sampled tokens reach the
host (services/worker/runner/in_flight.py): where a step's input is a row's newest token, still only
on the device in `latest[row]`, the host writes the id -(row + 1) instead
(services/worker/in_flight.fed_id), and this kernel, the
first one of the captured decode graph, replaces each such id in place with latest[row]. That
is one launch inside the graph instead of an eager gather, scatter and index upload between
two graphs. Non-negative ids are left alone; the host never writes a negative id otherwise
(token ids are checked against the vocabulary where requests enter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.runtime.tensor_checks import check_tensor

BLOCK = 256


@triton.jit
def _feed_kernel(ids_ptr, latest_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    fed = mask & (ids < 0)
    token = tl.load(latest_ptr + tl.where(fed, -ids - 1, 0), mask=fed, other=0)
    tl.store(ids_ptr + offs, token, mask=fed)


def feed_token_ids_(ids: torch.Tensor, latest: torch.Tensor) -> torch.Tensor:
    """ids [T] int64: every id -(row + 1) becomes latest[row], in place; returns ids. Rows are
    not range-checked (that would need a host sync): the host writes only rows it holds."""
    check_tensor("ids", ids, dtypes=(torch.int64,), ndim=1, contiguous=True)
    check_tensor(
        "latest", latest, dtypes=(torch.int64,), ndim=1, device=ids.device, contiguous=True
    )
    n = ids.shape[0]
    if n:
        _feed_kernel[(triton.cdiv(n, BLOCK),)](ids, latest, n, BLOCK=BLOCK)
    return ids


def feed_token_ids_reference(ids: torch.Tensor, latest: torch.Tensor) -> torch.Tensor:
    """What feed_token_ids_ makes of ids, in PyTorch (a new tensor)."""
    fed = ids < 0
    return torch.where(fed, latest[torch.where(fed, -ids - 1, 0)], ids)
