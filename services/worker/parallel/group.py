"""The tensor-parallel group of one worker: its rank, its size, and the collectives the sharded
layers call (all-reduce after a row-parallel Linear, all-gather of vocab-sharded logits).

A group of size 1 is the unsharded worker: every collective returns its input, so the layers
built for a group run unchanged without one. The process group is NCCL on CUDA (one process
per GPU) and gloo on CPU; its timeout bounds every collective, so a rank that died makes the
others raise instead of waiting for it forever (ranks.py then takes the group down).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (or no group at size 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place. Every rank ends with the same bits (ring
        all-reduce hands each reduced chunk around), so the replicated parts of the model that
        follow compute identically on every rank and sampling agrees without a broadcast."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` [..., n] concatenated in rank order along the last dim [..., size*n]."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (the KV block count every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()


def join_group(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Join the group's process group (every rank calls this with the same `init_method`)."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tp = TensorParallel(rank, size)
    # The first collective opens the connections (and NCCL's communicator), so the CUDA graphs
    # captured later find them ready and a rank that cannot connect fails at start-up.
    tp.all_reduce(torch.zeros(1, device=device))
    return tp


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
