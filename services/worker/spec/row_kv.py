"""A drafter's private paged KV cache: batch row r owns blocks [r * B, (r + 1) * B) of it, where
B = ceil(max_model_len / block_size), so a drafter needs no block allocator of its own."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata, build_attention_metadata
from services.worker.runner.kv_cache import KVCache
from shared.model.config import ModelConfig


class RowKV:
    def __init__(
        self,
        config: ModelConfig,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.num_kv_heads = config.num_key_value_heads
        self.blocks_per_row = -(-max_model_len // block_size)
        self.cache = KVCache.allocate(
            config, max_num_reqs * self.blocks_per_row, block_size, dtype, device
        )

    @property
    def layers(self) -> list[torch.Tensor]:
        return self.cache.layers

    def metadata(
        self, rows: np.ndarray, ends: np.ndarray, counts: np.ndarray, positions: np.ndarray
    ) -> AttentionMetadata | TritonAttentionMetadata:
        """Attention over each row's own blocks for the flat tokens at `positions` (`counts`
        per row, in `rows` order), each row's sequence ending at `ends`. The target's path for
        the device (Triton kernels on CUDA, whose metadata uploads without a host sync)."""
        bases = np.asarray(rows, dtype=np.int64) * self.blocks_per_row
        block = np.repeat(bases, counts) + positions // self.block_size
        return build_attention_metadata(
            num_kv_heads=self.num_kv_heads,
            query_lens=counts,
            seq_lens=ends,
            block_tables=bases[:, None] + np.arange(self.blocks_per_row)[None, :],
            block_size=self.block_size,
            slot_mapping=block * self.block_size + positions % self.block_size,
            device=self.device,
        )
