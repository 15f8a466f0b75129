"""Sparse per-row token lists (logit bias, allowed ids, banned ids, stop ids) as flat tensors.

Few requests carry such lists and each list is short next to the vocabulary, so a dense
[rows, V] tensor per kind would waste memory. Each row's entries are kept in Python (they
change only when a request joins or leaves the batch) and flattened into three device tensors
— row, token id, value — rebuilt lazily after a change (one staged upload). A sampling step
then addresses the entries of the rows in its batch with tensor ops only, whatever the number
of requests, and without a host sync: entries are never compacted (a boolean selection would
wait for the device to count them); those of rows outside the batch, or filtered out, point at
a scratch row after the batch's rows instead (transforms.py writes there and nobody reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshllm_kernels.runtime.staged_copy import stage_to_device


@dataclass(frozen=True)
class BatchEntries:
    """Entries addressed by batch index (not state row); those of rows not taking part point
    at the scratch row (the batch size)."""

    batch_idx: torch.Tensor  # int64 [N]
    token_ids: torch.Tensor  # int64 [N]
    values: torch.Tensor  # float32 [N]

    def __len__(self) -> int:
        return int(self.batch_idx.shape[0])


class RowTokens:
    """Token ids (with a float value each) per state row."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rows: dict[int, tuple[list[int], list[float]]] = {}
        self._flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __contains__(self, row: int) -> bool:
        return row in self._rows

    def set(self, row: int, token_ids: list[int], values: list[float] | None = None) -> None:
        """Replace row's entries; an empty list clears the row."""
        if not token_ids:
            self.clear(row)
            return
        self._rows[row] = (list(token_ids), list(values) if values else [0.0] * len(token_ids))
        self._flat = None

    def clear(self, row: int) -> None:
        if self._rows.pop(row, None) is not None:
            self._flat = None

    def _flatten(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._flat is None:
            rows: list[int] = []
            tokens: list[int] = []
            values: list[float] = []
            for row, (ids, vals) in self._rows.items():
                rows.extend([row] * len(ids))
                tokens.extend(ids)
                values.extend(vals)
            ids = stage_to_device(np.array([rows, tokens], np.int64).reshape(2, -1), self.device)
            self._flat = (
                ids[0],
                ids[1],
                stage_to_device(np.array(values, np.float32), self.device),
            )
        return self._flat

    def in_batch(
        self, batch_pos: torch.Tensor, scratch: int, row_filter: torch.Tensor | None = None
    ) -> BatchEntries:
        """Every entry, addressed by batch index: `batch_pos[row]` is its row's batch index or
        -1 (not in the batch). Entries of rows not in the batch, and of rows where
        `row_filter` (bool per state row) is False, point at row `scratch` instead."""
        rows, tokens, values = self._flatten()
        idx = batch_pos[rows]
        keep = idx >= 0
        if row_filter is not None:
            keep &= row_filter[rows]
        return BatchEntries(torch.where(keep, idx, scratch), tokens, values)
