"""The vocabulary split across a tensor-parallel group: each rank holds rows
`vocab_rows_of_rank` of the embedding and the LM head (the vocabulary padded to a multiple of
the group size; padding rows are zero and their logits are cut off after the gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.parallel.group import TensorParallel
from services.worker.parallel.shard_config import vocab_rows_of_rank


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up the ids in its rows, zero elsewhere; the all-reduce sums the one
    rank's row per token (the others add exact zeros, so the result equals the lookup)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        rows = vocab_rows_of_rank(vocab_size, tp)
        super().__init__(len(rows), hidden_size)
        self.first_row = rows.start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Every rank's logits [R, vocab / N] -> the whole logits [R, vocab] on every rank."""
    if tp.size == 1:
        return local
    return tp.all_gather_last(local)[:, :vocab_size]
