"""Which heads and rows each rank of a tensor-parallel group holds (pure, no process group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.worker.parallel.group import TensorParallel
from services.worker.parallel.shard_config import (
    ShardingError,
    kv_heads_of_rank,
    q_heads_of_rank,
    rank_config,
)
from services.worker.parallel.shards import ShardPlan
from shared.model.config import ModelConfig


def config(heads: int, kv: int, vocab: int = 10, inter: int = 8) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": heads * 4,
            "head_dim": 4,
            "intermediate_size": inter,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "vocab_size": vocab,
            "max_position_embeddings": 32,
        }
    )


def ranks(n: int) -> list[TensorParallel]:
    return [TensorParallel(rank, n) for rank in range(n)]


@pytest.mark.parametrize(
    ("heads", "kv", "n", "kv_ranges", "q_ranges"),
    [
        (4, 2, 2, [(0, 1), (1, 2)], [(0, 2), (2, 4)]),  # even split
        (9, 3, 2, [(0, 1), (1, 3)], [(0, 3), (3, 9)]),  # SmolLM2: uneven, by KV head
        (4, 1, 2, [(0, 1), (0, 1)], [(0, 2), (2, 4)]),  # one KV head, replicated
        (8, 2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)], [(0, 2), (2, 4), (4, 6), (6, 8)]),
    ],
)
def test_heads_of_each_rank(heads: int, kv: int, n: int, kv_ranges: list, q_ranges: list) -> None:
    cfg = config(heads, kv)
    assert [(r.start, r.stop) for r in (kv_heads_of_rank(cfg, tp) for tp in ranks(n))] == kv_ranges
    assert [(r.start, r.stop) for r in (q_heads_of_rank(cfg, tp) for tp in ranks(n))] == q_ranges
    local = [rank_config(cfg, tp) for tp in ranks(n)]
    assert sum(c.num_attention_heads for c in local) == heads
    assert all(c.intermediate_size == cfg.intermediate_size // n for c in local)


def test_unsplittable_models_are_refused() -> None:
    with pytest.raises(ShardingError):
        rank_config(config(6, 2), TensorParallel(0, 4))  # 2 KV heads over 4 ranks, 6 q heads
    with pytest.raises(ShardingError):
        rank_config(config(4, 2, inter=6), TensorParallel(0, 4))


def test_read_from_safetensors_equals_slicing_the_whole_tensor(tmp_path: Path) -> None:
    """The lazy read (only the rank's bytes) and the GGUF path's slice agree, padding and the
    rank-0-only row-parallel bias included."""
    cfg = config(4, 2, vocab=9)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 16),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 8),
        "model.embed_tokens.weight": torch.randn(9, 16),
        "model.norm.weight": torch.randn(16),
    }
    save_file(tensors, str(tmp_path / "m.safetensors"))
    for tp in ranks(2):
        plan = ShardPlan(cfg, tp)
        with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as handle:
            for name, whole in tensors.items():
                assert torch.equal(plan.read(name, handle), plan.take(name, whole)), name
        embed = plan.take("model.embed_tokens.weight", tensors["model.embed_tokens.weight"])
        assert embed.shape == (5, 16)  # 9 rows padded to 10, 5 per rank
        if tp.rank == 1:
            assert torch.equal(embed[:4], tensors["model.embed_tokens.weight"][5:])
            assert not embed[4].any()
        bias = plan.take(
            "model.layers.0.self_attn.o_proj.bias", tensors["model.layers.0.self_attn.o_proj.bias"]
        )
        assert bias.any() == (tp.rank == 0)
        k = plan.take(
            "model.layers.0.self_attn.k_proj.weight",
            tensors["model.layers.0.self_attn.k_proj.weight"],
        )
        assert torch.equal(k, tensors["model.layers.0.self_attn.k_proj.weight"][4 * tp.rank :][:4])
