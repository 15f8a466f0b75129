"""A drafter's private paged KV cache: per batch row, the blocks holding that row's positions.

The drafter writes positions past the request's verified tokens (its own speculative steps),
so it cannot use the scheduler's block tables, and it must never touch the target's cache.
Blocks come from a pool of its own that grows on demand (doubling; block ids stay valid
across growth because the old blocks are copied to the same indices) and takes back a row's
blocks when its request leaves the batch (`release`). So the drafter's KV costs what its live
rows hold, not max_num_reqs x max_model_len (which for a one-layer head of an 8B target would
be GBs), and it has no limit of its own besides memory.

Growth happens while building a forward's metadata, before any kernel of that forward is
launched: an eager step, never inside a captured graph.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.backend_choice import resolve_backend
from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata, build_attention_metadata
from services.worker.runner.kv_cache import KVCache
from shared.kv.groups import KVGroupSpec
from shared.model.config import ModelConfig

#: blocks allocated at first (grown by doubling)
INITIAL_BLOCKS = 64


class RowKV:
    def __init__(
        self,
        config: ModelConfig,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        non_causal: bool = False,
    ) -> None:
        self.config = config
        self.non_causal = non_causal
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_kv_heads = config.num_key_value_heads
        self.blocks_per_row = -(-max_model_len // block_size)
        self.tables = np.zeros((max_num_reqs, self.blocks_per_row), dtype=np.int64)
        self.num_row_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Per row: positions [0, written) hold the KV of the row's current request (what its
        # drafter computed from the request's own tokens); past it, whatever the pool blocks
        # held before. 0 when the row's request leaves (`release`).
        self.written = np.zeros(max_num_reqs, dtype=np.int64)
        self.cache = KVCache.allocate(config, INITIAL_BLOCKS, block_size, dtype, device)
        # One full-attention group over the drafter's own layers, in the model dtype: the
        # backend is resolved once, here (backend_choice.py); `non_causal` (a block drafter's
        # forwards) is refused by a backend that cannot compute it.
        layers = list(range(config.num_hidden_layers))
        self.backend = resolve_backend(
            device, [KVGroupSpec(kind="full", layer_indices=layers)], dtype, non_causal=non_causal
        )
        self.free = list(range(INITIAL_BLOCKS - 1, -1, -1))  # a stack: pop() gives low ids

    @property
    def layers(self) -> list[torch.Tensor]:
        return self.cache.attention_layers  # a drafter's cache: attention layers only

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def release(self, row: int) -> None:
        """The row's request left: its blocks go back to the pool."""
        n = int(self.num_row_blocks[row])
        self.free.extend(self.tables[row, :n].tolist()[::-1])
        self.num_row_blocks[row] = 0
        self.written[row] = 0

    def metadata(
        self, rows: np.ndarray, ends: np.ndarray, counts: np.ndarray, positions: np.ndarray
    ) -> AttentionMetadata | TritonAttentionMetadata:
        """Attention over each row's own blocks for the flat tokens at `positions` (`counts`
        per row, in `rows` order), each row's sequence ending at `ends`; blocks up to each
        end are allocated first. The target's path for the device (Triton kernels on CUDA,
        whose metadata uploads without a host sync). A `non_causal` cache's forwards are
        non-causal: each query sees its row's whole sequence up to its end."""
        rows = np.asarray(rows, dtype=np.int64)
        slots = self.slots(rows, ends, counts, positions)
        return build_attention_metadata(
            num_kv_heads=self.num_kv_heads,
            backend=self.backend,
            query_lens=counts,
            seq_lens=ends,
            block_tables=self.tables[rows],
            block_size=self.block_size,
            slot_mapping=slots,
            device=self.device,
            causal=not self.non_causal,
        )

    def slots(
        self, rows: np.ndarray, ends: np.ndarray, counts: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """The cache slots of the flat tokens at `positions` (`counts` per row, in `rows`
        order), blocks up to each row's `ends` allocated first."""
        rows = np.asarray(rows, dtype=np.int64)
        self.reserve(rows, np.asarray(ends, dtype=np.int64))
        tables = self.tables[rows]
        block = tables[np.repeat(np.arange(len(rows)), counts), positions // self.block_size]
        return block * self.block_size + positions % self.block_size  # type: ignore[no-any-return]

    def reserve(self, rows: np.ndarray, ends: np.ndarray) -> None:
        """Blocks holding positions [0, end) of each row (the pool grows when it must)."""
        needed = -(-ends // self.block_size)
        if (needed > self.blocks_per_row).any():
            raise ValueError(f"drafter positions up to {int(ends.max())} exceed max_model_len")
        missing = int(np.maximum(needed - self.num_row_blocks[rows], 0).sum())
        if missing > len(self.free):
            self._grow(missing - len(self.free))
        for row, n in zip(rows.tolist(), needed.tolist(), strict=True):
            have = int(self.num_row_blocks[row])
            for i in range(have, n):
                self.tables[row, i] = self.free.pop()
            self.num_row_blocks[row] = max(have, n)

    def grow_to(self, num_blocks: int) -> None:
        """A pool of at least `num_blocks` blocks (graphs captured over it stay valid while it
        does not grow again: accel/draft_graphs.py)."""
        if num_blocks > self.cache.num_blocks:
            self._grow(num_blocks - self.cache.num_blocks)

    def _grow(self, at_least: int) -> None:
        old = self.cache.num_blocks
        new = max(2 * old, old + at_least)
        grown = KVCache.allocate(self.config, new, self.block_size, self.dtype, self.device)
        for dst, src in zip(grown.attention_layers, self.cache.attention_layers, strict=True):
            dst[:, :old].copy_(src)
        self.cache = grown
        self.free = list(range(new - 1, old - 1, -1)) + self.free
