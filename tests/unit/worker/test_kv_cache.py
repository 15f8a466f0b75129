"""KV cache sizing from a byte budget and its documented layout."""

from __future__ import annotations

import pytest
import torch

from services.worker.runner.kv_cache import (
    KVCache,
    KVCacheSizeError,
    available_memory_bytes,
    budget_blocks,
    bytes_per_block,
)
from shared.model.config import ModelConfig

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=100,
)


def test_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    # 2 (K, V) * 16 tokens * 2 kv heads * 16 dims * 4 bytes * 3 layers
    assert bytes_per_block(CONFIG, 16, torch.float32) == 2 * 16 * 2 * 16 * 4 * 3
    assert bytes_per_block(CONFIG, 16, torch.bfloat16) == 2 * 16 * 2 * 16 * 2 * 3


def test_blocks_from_an_explicit_budget_and_layout() -> None:
    per_block = bytes_per_block(CONFIG, 8, torch.bfloat16)
    budget = 10 * per_block + per_block // 2
    num_blocks = budget_blocks(CONFIG, 8, torch.bfloat16, "cpu", kv_cache_bytes=budget)
    cache = KVCache.allocate(CONFIG, num_blocks, 8, torch.bfloat16, "cpu")
    assert cache.num_blocks == 10
    assert len(cache.layers) == 3
    assert cache.layers[0].shape == (2, 10, 8, 2, 16)
    assert cache.layers[0].dtype == torch.bfloat16
    assert cache.nbytes == 10 * per_block
    assert cache.num_slots == 80
    assert all(bool((layer == 0).all()) for layer in cache.layers)
    # layers are separate storage: writing one leaves the others untouched
    cache.layers[1][0, 3, 2] = 1.0
    assert bool((cache.layers[0] == 0).all())


def test_fraction_of_available_memory() -> None:
    available = available_memory_bytes(torch.device("cpu"))
    assert available > 0
    per_block = bytes_per_block(CONFIG, 16, torch.float32)
    blocks = budget_blocks(CONFIG, 16, torch.float32, "cpu", memory_fraction=0.01)
    # available memory moves between the two reads: within a factor, not exactly
    assert 0.5 * available * 0.01 <= blocks * per_block <= 2 * available * 0.01


def test_budget_below_one_block_is_a_clear_error() -> None:
    with pytest.raises(KVCacheSizeError, match="holds no block"):
        budget_blocks(CONFIG, 16, torch.float32, "cpu", kv_cache_bytes=100)
