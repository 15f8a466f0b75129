"""KV chunks across a tensor-parallel group: the canonical full-head payload body from the
ranks' head shards (stores), and each rank's head shard from it (loads).

Why one canonical layout: a payload is addressed by a token prefix of one model and layout
(shared.kv.offload_key), and any group may read it: another replica, the decode side of P/D,
a group restarted with another MESHLLM_TP. So every group writes the body a TP=1 worker writes,
[layers, 2, block_size, all KV heads in checkpoint order, head_dim], and a reader of any TP size
takes its heads from it. (Per-rank payloads would need the layout in the key and a refusal or a
conversion for every mismatched reader; this way there is nothing to mismatch.)

Each rank holds the KV heads `ranges[rank]` (parallel/shard_config.py: contiguous runs, possibly
of different lengths, or one head replicated on several ranks when the model has fewer KV heads
than ranks). Collectives need equal shapes, so a shard travels padded to the largest rank's
head count. A replicated head is taken from the first rank that holds it (its copies are bit
for bit the same: every rank computes it from the same all-reduced hidden state).

Every call is a collective: every rank makes it, in the same order, with the same shapes
(rank 0 decides what moves and tells the followers through their command pipe, ranks.py).
Rank 0 is the root: it alone talks to Redis, so it alone holds whole chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.worker.parallel.group import SINGLE, TensorParallel
from services.worker.parallel.shard_config import kv_heads_of_rank
from shared.model.config import ModelConfig

ROOT = 0


@dataclass(frozen=True)
class KVHeadShards:
    """Which KV heads each rank of `tp`'s group holds, and the two collectives over them."""

    tp: TensorParallel
    ranges: tuple[range, ...]  # per rank, the KV heads it holds (indices into all heads)

    @classmethod
    def of_model(cls, config: ModelConfig, tp: TensorParallel = SINGLE) -> KVHeadShards:
        """From the model's full config (not a rank's): the split the loader made."""
        ranges = tuple(kv_heads_of_rank(config, TensorParallel(r, tp.size)) for r in range(tp.size))
        return cls(tp, ranges)

    @classmethod
    def of_heads(cls, num_heads: int) -> KVHeadShards:
        """One rank holding all `num_heads` KV heads (no group)."""
        return cls(SINGLE, (range(num_heads),))

    @property
    def num_heads(self) -> int:
        """All KV heads of the model: the heads of a payload."""
        return max(r.stop for r in self.ranges)

    @property
    def local(self) -> range:
        return self.ranges[self.tp.rank]

    @property
    def sharded(self) -> bool:
        return self.tp.size > 1

    @property
    def _padded(self) -> int:
        return max(len(r) for r in self.ranges)

    def gather(self, local: torch.Tensor) -> torch.Tensor | None:
        """`local` [..., local heads, head_dim] of every rank -> on rank 0 the chunks with
        every head [..., num_heads, head_dim]; None on the other ranks."""
        if not self.sharded:
            return local
        padded = self._pad(local)
        parts = [torch.empty_like(padded) for _ in self.ranges] if self.tp.rank == ROOT else None
        dist.gather(padded, parts, dst=ROOT, group=self.tp.group)
        if parts is None:
            return None
        shape = (*local.shape[:-2], self.num_heads, local.shape[-1])
        full = local.new_empty(shape)
        covered = 0  # heads [0, covered) are taken: each from the first rank holding it
        for heads, part in zip(self.ranges, parts, strict=True):
            if heads.stop > covered:
                first = max(heads.start, covered)
                full[..., first : heads.stop, :] = part[..., first - heads.start : len(heads), :]
                covered = heads.stop
        assert covered == self.num_heads, f"ranks {self.ranges} leave KV heads unheld"
        return full

    def scatter(
        self,
        full: torch.Tensor | None,
        leading: Sequence[int],
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Rank 0's `full` [*leading, num_heads, head_dim] -> this rank's heads of it
        [*leading, local heads, head_dim] (contiguous), on every rank. Only rank 0 passes `full`;
        every rank passes the same `leading` shape."""
        if not self.sharded:
            assert full is not None
            return full
        out = torch.empty((*leading, self._padded, head_dim), dtype=dtype, device=device)
        parts = None
        if self.tp.rank == ROOT:
            assert full is not None and tuple(full.shape[:-2]) == tuple(leading)
            parts = [self._pad(full[..., heads.start : heads.stop, :]) for heads in self.ranges]
        dist.scatter(out, parts, src=ROOT, group=self.tp.group)
        return out[..., : len(self.local), :].contiguous()

    def _pad(self, heads: torch.Tensor) -> torch.Tensor:
        missing = self._padded - heads.shape[-2]
        if missing == 0:
            return heads.contiguous()
        pad = heads.new_zeros((*heads.shape[:-2], missing, heads.shape[-1]))
        return torch.cat([heads, pad], dim=-2).contiguous()
