"""Building the worker's KV connector from its settings (the only place that knows both), and
a follower rank's part of the data path (tensor parallelism: connector.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.worker.kv_offload.connector import KVConnector
from services.worker.kv_offload.group_blocks import GroupKVBlocks, KVFollower
from services.worker.kv_offload.head_shards import KVHeadShards
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import LAYOUT_VERSION
from services.worker.kv_offload.transfer_engine import TransferEngine
from services.worker.parallel.group import TensorParallel
from services.worker.runner.kv_cache import KVCache
from shared.config import WorkerSettings
from shared.kv.offload_key import KeySpace
from shared.model.config import ModelConfig
from shared.model.source import ModelSource


def key_space(settings: WorkerSettings, model_name: str) -> KeySpace:
    """The payload key space: the cluster, the served model name (WorkerReady.model, which is
    what the scheduler sees) and this worker's payload layout version."""
    return KeySpace(settings.cluster, model_name, LAYOUT_VERSION)


def layer_groups(config: Any) -> list[list[int]] | None:
    """The layers of each attention KV cache group in shared.kv.groups order
    (`ModelConfig.kv_groups`), so a chunk's group index means the same thing to the scheduler
    and to this worker. None (one group of every layer) for a config that declares no groups.

    State groups (hybrid models' Mamba layers) are left out: the tier's prefix cache stores
    attention groups only (shared/kv/groups.py), and they come after every attention group, so
    the attention groups keep their indices. `transfer_groups` adds them for P/D."""
    groups = getattr(config, "kv_groups", None)
    if not groups:
        return None
    attention = [list(g.layer_indices) for g in groups if g.kind != "state"]
    if not attention:
        raise ValueError(
            "the KV offload tier stores attention KV only: a model without attention layers "
            "cannot use it (turn the tier off)"
        )
    return attention


def transfer_groups(config: Any) -> list[list[int]] | None:
    """Every KV cache group this worker moves, in shared.kv.groups order: the attention groups
    (`layer_groups`) and then the state groups of a hybrid model. A state group's chunks are
    only ever asked for under P/D ("transferable is not storable": the scheduler's prefix
    cache in the tier stays attention-only), and their payload is the state layout of
    group_blocks.py. None (one group of every layer) for a config that declares no groups."""
    attention = layer_groups(config)
    if attention is None:
        return None
    state = [list(g.layer_indices) for g in config.kv_groups if g.kind == "state"]
    return [*attention, *state]


def head_shards(source: ModelSource, tp: TensorParallel) -> KVHeadShards | None:
    """The group's KV head split, from the model's own config (a rank's config has only its
    heads); None at TP=1, where the cache holds every head."""
    if tp.size == 1:
        return None
    return KVHeadShards.of_model(ModelConfig.from_hf_dir(source.hf_dir), tp)


def build_follower(
    settings: WorkerSettings,
    kv_cache: KVCache,
    config: Any,
    source: ModelSource,
    tp: TensorParallel,
) -> KVFollower:
    """Rank `tp.rank` > 0's side of the data path: no Redis, only rank 0's collectives."""
    shards = head_shards(source, tp)
    assert shards is not None
    space = key_space(settings, source.name)
    return KVFollower(GroupKVBlocks(kv_cache, space, shards, layer_groups(config)))


def build_connector(
    settings: WorkerSettings,
    kv_cache: KVCache,
    config: Any,
    model_name: str,
    worker_incarnation: str,
    notify: Callable[[], None] | None = None,
    shards: KVHeadShards | None = None,
    followers: Callable[[str, Any], None] | None = None,
) -> KVConnector:
    """Rank 0's connector (the only one at TP=1). Sharded: `shards` is the group's head split
    and `followers` sends the other ranks a runner call (parallel/ranks.py)."""
    engine = TransferEngine(
        settings.redis_url,
        HostTier(settings.kv_host_tier_bytes),
        timeout_s=settings.kv_offload_timeout_s,
        max_busy_share=settings.kv_store_max_busy_share,
    )
    return KVConnector(
        kv_cache,
        engine,
        key_space(settings, model_name),
        worker_id=settings.instance_id,
        worker_incarnation=worker_incarnation,
        # Sharded (TP > 1), the state tensors are split by Mamba head and the chunk collectives
        # move K/V heads only: the state groups are left out there (a decode side's load of a
        # state chunk then fails and it recomputes the prompt).
        layer_groups=layer_groups(config) if shards is not None else transfer_groups(config),
        staging_bytes=settings.kv_staging_bytes,
        notify=notify,
        shards=shards,
        followers=followers,
    )
