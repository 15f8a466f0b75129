"""What one rank of a tensor-parallel group holds, as the ModelConfig its model is built from.

Megatron-style: attention heads are split across the ranks (each rank keeps its q heads and the
KV heads they read, split at KV-head granularity, so ranks may hold different head counts; with
fewer KV heads than ranks, a KV head is replicated on the ranks whose q heads use it), and
every MLP's intermediate dimension is split, MoE experts included (each
rank holds a 1/N slice of every expert, so routing is the same computation on every rank and
the routed-experts output is unchanged). Hidden size and vocabulary stay whole in the config:
the embedding and LM head split the vocabulary themselves (parallel/layers.py).

So a rank's model, KV cache, attention metadata and CUDA graphs read their sizes from the rank
config with no TP arithmetic of their own; loading checks every shard against it.
"""

from __future__ import annotations

from services.worker.parallel.group import TensorParallel
from shared.model.config import ModelConfig


class ShardingError(ValueError):
    """The model cannot be split over this many ranks."""


def kv_heads_of_rank(config: ModelConfig, tp: TensorParallel) -> range:
    """The KV heads rank `tp.rank` holds (in checkpoint order).

    With at least as many KV heads as ranks, each rank takes a contiguous run of them, as even
    as the count allows (SmolLM2's 3 over 2 ranks: 1 and 2), with all the q heads that read
    them, so uneven head counts still split. With fewer KV heads than ranks, the ranks are
    grouped per KV head (their count must divide the ranks) and split its q heads evenly."""
    heads, kv, n = config.num_attention_heads, config.num_key_value_heads, tp.size
    if kv >= n:
        return range(tp.rank * kv // n, (tp.rank + 1) * kv // n)
    if n % kv or heads % n:
        raise ShardingError(
            f"{heads} attention heads with {kv} KV heads do not split over {n} ranks"
        )
    head = tp.rank // (n // kv)
    return range(head, head + 1)


def q_heads_of_rank(config: ModelConfig, tp: TensorParallel) -> range:
    heads, kv, n = config.num_attention_heads, config.num_key_value_heads, tp.size
    if kv >= n:
        kv_heads = kv_heads_of_rank(config, tp)
        group = heads // kv  # q heads per KV head
        return range(kv_heads.start * group, kv_heads.stop * group)
    per = heads // n
    return range(tp.rank * per, (tp.rank + 1) * per)


def _split(size: int, tp: TensorParallel, what: str) -> int:
    if size % tp.size:
        raise ShardingError(f"{what}={size} does not split over {tp.size} ranks")
    return size // tp.size


def rank_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config of rank `tp.rank`'s shard (the config itself at size 1)."""
    if tp.size == 1:
        return config
    update = {
        "num_attention_heads": len(q_heads_of_rank(config, tp)),
        "num_key_value_heads": len(kv_heads_of_rank(config, tp)),
        "intermediate_size": _split(config.intermediate_size, tp, "intermediate_size"),
    }
    if config.moe_intermediate_size:
        update["moe_intermediate_size"] = _split(
            config.moe_intermediate_size, tp, "moe_intermediate_size"
        )
    if config.shared_expert_intermediate_size:
        update["shared_expert_intermediate_size"] = _split(
            config.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size"
        )
    return config.model_copy(update=update)


def vocab_rows_of_rank(vocab_size: int, tp: TensorParallel) -> range:
    """The embedding/LM-head rows rank `tp.rank` holds: the vocabulary padded to a multiple of
    the group size, split evenly (rows past `vocab_size` are zero padding)."""
    per = -(-vocab_size // tp.size)
    return range(tp.rank * per, (tp.rank + 1) * per)
