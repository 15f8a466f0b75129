"""The drafters' private KV pool: rows get blocks as their positions grow, the pool doubles
when it runs out without moving any written block, and a released row's blocks are reused."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.spec.row_kv import INITIAL_BLOCKS, RowKV
from shared.model.config import ModelConfig

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=64,
)  # fmt: skip


def test_blocks_follow_the_rows_and_the_pool_grows_in_place() -> None:
    kv = RowKV(CONFIG, 4, 4096, 16, torch.float32, torch.device("cpu"))
    assert kv.num_blocks == INITIAL_BLOCKS
    kv.metadata(np.array([0]), np.array([40]), np.array([40]), np.arange(40))
    first = kv.tables[0, :3].tolist()
    assert len(set(first)) == 3 and kv.num_row_blocks[0] == 3
    kv.layers[0][:, first[2]] = 7.0  # what row 0 wrote at positions 32..39
    big = 16 * INITIAL_BLOCKS  # a long second row: more blocks than the pool holds
    kv.metadata(np.array([1]), np.array([big]), np.array([1]), np.array([big - 1]))
    assert kv.num_blocks >= 3 + INITIAL_BLOCKS
    assert kv.tables[0, :3].tolist() == first
    assert (kv.layers[0][:, first[2]] == 7.0).all()  # copied to the same block id
    row1 = set(kv.tables[1, : kv.num_row_blocks[1]].tolist())
    assert not row1 & set(first)  # rows never share a block
    free = len(kv.free)
    kv.release(1)
    assert len(kv.free) == free + len(row1) and kv.num_row_blocks[1] == 0
    size = kv.num_blocks
    kv.metadata(np.array([2]), np.array([big]), np.array([1]), np.array([big - 1]))
    assert kv.num_blocks == size  # row 1's blocks served row 2: no growth
