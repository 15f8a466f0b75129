"""KV chunks across a real two-rank gloo group: every rank's head shard gathered on rank 0 is
the whole chunk, heads in checkpoint order, and a whole chunk scattered from rank 0 gives each
rank exactly its heads: for an even split, an uneven one (1 + 2 heads: shards travel padded)
and a KV head replicated on both ranks (taken once)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.worker.kv_offload.head_shards import KVHeadShards
from services.worker.parallel.group import TensorParallel
from shared.model.config import ModelConfig
from tests.support.tp_ranks import run_ranks

HEAD_DIM = 8
LEADING = (3, 2, 2, 4)  # chunks, layers, K/V, block size
SPLITS = {"even": (4, 2), "uneven": (6, 3), "replicated": (4, 1)}  # q heads, KV heads


def _config(q_heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=q_heads * HEAD_DIM,
        num_hidden_layers=2,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        intermediate_size=32,
        vocab_size=64,
    )


def _whole(kv_heads: int) -> torch.Tensor:
    """Distinct values everywhere, so a head out of place cannot go unnoticed."""
    n = 1
    for d in (*LEADING, kv_heads, HEAD_DIM):
        n *= d
    return torch.arange(n, dtype=torch.float32).view(*LEADING, kv_heads, HEAD_DIM)


def _rank(tp: TensorParallel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (q_heads, kv_heads) in SPLITS.items():
        shards = KVHeadShards.of_model(_config(q_heads, kv_heads), tp)
        whole = _whole(kv_heads)
        local = whole[..., shards.local.start : shards.local.stop, :]
        gathered = shards.gather(local.clone())
        scattered = shards.scatter(
            whole if tp.rank == 0 else None, LEADING, HEAD_DIM, torch.float32, torch.device("cpu")
        )
        out[name] = {
            "ranges": [(r.start, r.stop) for r in shards.ranges],
            "num_heads": shards.num_heads,
            "gathered_ok": None if gathered is None else bool(torch.equal(gathered, whole)),
            "scattered_ok": bool(torch.equal(scattered, local)),
            "contiguous": scattered.is_contiguous(),
        }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_rank, 2)


@pytest.mark.parametrize(
    ("split", "ranges"),
    [("even", [(0, 1), (1, 2)]), ("uneven", [(0, 1), (1, 3)]), ("replicated", [(0, 1), (0, 1)])],
)
def test_gather_and_scatter_over_two_ranks(
    ranks: list[dict[str, Any]], split: str, ranges: list[tuple[int, int]]
) -> None:
    rank0, rank1 = (r[split] for r in ranks)
    assert rank0["ranges"] == rank1["ranges"] == ranges
    assert rank0["num_heads"] == SPLITS[split][1]
    assert rank0["gathered_ok"] is True  # rank 0 holds the whole chunk
    assert rank1["gathered_ok"] is None  # the others hold nothing
    assert rank0["scattered_ok"] and rank1["scattered_ok"]
    assert rank0["contiguous"] and rank1["contiguous"]


def test_one_rank_moves_nothing() -> None:
    shards = KVHeadShards.of_heads(3)
    whole = _whole(3)
    assert not shards.sharded and shards.num_heads == 3
    assert shards.gather(whole) is whole
    assert shards.scatter(whole, LEADING, HEAD_DIM, torch.float32, torch.device("cpu")) is whole
