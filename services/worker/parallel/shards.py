"""Which slice of each checkpoint tensor a rank loads, by its HF name (both loaders reduce their
input to HF names, loader/checkpoint_names.py).

- column-parallel (output rows split): q_proj by q heads, k_proj/v_proj by the rank's KV heads
  (replicated when fewer than ranks), gate/up projections of every MLP and expert (w1/w3);
- row-parallel (input columns split): o_proj by q heads, down projections (w2); their bias
  is added once, after the all-reduce, so only rank 0 keeps it (the others hold zeros);
- vocab-parallel: embed_tokens and lm_head rows, the vocabulary padded to a multiple of ranks;
- everything else is replicated: norms (Qwen3's per-head q/k norms too), the MoE router, the
  shared expert's gate.

`ShardPlan.take` slices a loaded tensor; `ShardPlan.read` reads only the slice from a
safetensors file (a rank never holds the whole model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.worker.parallel.group import TensorParallel
from services.worker.parallel.shard_config import (
    kv_heads_of_rank,
    q_heads_of_rank,
    vocab_rows_of_rank,
)
from shared.model.config import ModelConfig

_COLUMN_EVEN = frozenset({"gate_proj", "up_proj", "w1", "w3"})
_ROW_EVEN = frozenset({"down_proj", "w2"})
_VOCAB = frozenset({"embed_tokens", "lm_head"})


@dataclass(frozen=True)
class Slice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor; rows past the tensor's end
    are zero padding (the padded vocabulary)."""

    dim: int
    start: int
    stop: int


ZERO = "zero"  # a row-parallel bias on ranks other than 0
Shard = Slice | str | None  # None: the whole tensor


class ShardPlan:
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        self.tp = tp
        hd = config.head_dim
        q = q_heads_of_rank(config, tp)
        kv = kv_heads_of_rank(config, tp)
        self._q = Slice(0, q.start * hd, q.stop * hd)
        self._kv = Slice(0, kv.start * hd, kv.stop * hd)
        vocab = vocab_rows_of_rank(config.vocab_size, tp)
        self._vocab = Slice(0, vocab.start, vocab.stop)

    def shard(self, hf_name: str, shape: tuple[int, ...]) -> Shard:
        if self.tp.size == 1:
            return None
        pieces = hf_name.split(".")
        module, kind = (pieces[-2], pieces[-1]) if len(pieces) >= 2 else ("", "")
        if module == "q_proj":
            return self._q
        if module in ("k_proj", "v_proj"):
            return self._kv
        if module == "o_proj":  # its input columns are the rank's q heads
            if kind == "bias":
                return None if self.tp.rank == 0 else ZERO
            return Slice(1, self._q.start, self._q.stop)
        if module in _COLUMN_EVEN:
            return self._even(0, shape[0])
        if module in _ROW_EVEN:
            if kind == "bias":
                return None if self.tp.rank == 0 else ZERO
            return self._even(1, shape[1])
        if module in _VOCAB:
            return self._vocab
        return None

    def _even(self, dim: int, size: int) -> Slice:
        per = size // self.tp.size
        if per * self.tp.size != size:
            raise ValueError(f"dimension {size} does not split over {self.tp.size} ranks")
        return Slice(dim, self.tp.rank * per, (self.tp.rank + 1) * per)

    def take(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of a whole tensor (a copy, so the whole one can be freed)."""
        shard = self.shard(hf_name, tuple(tensor.shape))
        if shard is None:
            return tensor
        if shard == ZERO:
            return torch.zeros_like(tensor)
        assert isinstance(shard, Slice)
        stop = min(shard.stop, tensor.shape[shard.dim])
        part = tensor.narrow(shard.dim, shard.start, max(0, stop - shard.start))
        return _pad_rows(part.clone(), shard)

    def read(self, hf_name: str, handle: Any) -> torch.Tensor:
        """The rank's part of `hf_name` read from an open safetensors file: only its bytes."""
        lazy = handle.get_slice(hf_name)
        shape = tuple(lazy.get_shape())
        shard = self.shard(hf_name, shape)
        if shard is None:
            return handle.get_tensor(hf_name)  # type: ignore[no-any-return]
        if shard == ZERO:  # a bias: small
            return torch.zeros_like(handle.get_tensor(hf_name))
        assert isinstance(shard, Slice)
        stop = min(shard.stop, shape[shard.dim])
        start = min(shard.start, stop)
        part = lazy[start:stop] if shard.dim == 0 else lazy[:, start:stop]
        return _pad_rows(part, shard)


def _pad_rows(part: torch.Tensor, shard: Slice) -> torch.Tensor:
    missing = (shard.stop - shard.start) - part.shape[shard.dim]
    if missing <= 0:
        return part
    pad_shape = list(part.shape)
    pad_shape[shard.dim] = missing
    return torch.cat([part, part.new_zeros(pad_shape)], dim=shard.dim)
