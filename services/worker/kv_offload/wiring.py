"""Building the worker's KV connector from its settings (the only place that knows both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.worker.kv_offload.connector import KVConnector
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import LAYOUT_VERSION
from services.worker.kv_offload.transfer_engine import TransferEngine
from services.worker.runner.kv_cache import KVCache
from shared.config import WorkerSettings
from shared.kv.offload_key import KeySpace


def key_space(settings: WorkerSettings, model_name: str) -> KeySpace:
    """The payload key space: the cluster, the served model name (WorkerReady.model, which is
    what the scheduler sees) and this worker's payload layout version."""
    return KeySpace(settings.cluster, model_name, LAYOUT_VERSION)


def layer_groups(config: Any) -> list[list[int]] | None:
    """The layers of each KV cache group in shared.kv.groups order (`ModelConfig.kv_groups`),
    so a chunk's group index means the same thing to the scheduler and to this worker. None
    (one group of every layer) for a config that declares no groups."""
    groups = getattr(config, "kv_groups", None)
    return [list(g.layer_indices) for g in groups] if groups else None


def build_connector(
    settings: WorkerSettings,
    kv_cache: KVCache,
    config: Any,
    model_name: str,
    worker_incarnation: str,
    notify: Callable[[], None] | None = None,
) -> KVConnector:
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
        layer_groups=layer_groups(config),
        staging_bytes=settings.kv_staging_bytes,
        notify=notify,
    )
