"""The worker service's edge of KV offload: publishes KVTransferDone messages on the results
stream and copies finished loads into the KV cache while no step runs.

The scheduler does not schedule a loading request until its load is reported, and it may have
nothing else to run, so a load must complete between steps too: the transfer threads wake this
pump (thread-safe), which takes the step lock (no forward in flight), applies the ready loads
and publishes. A message that fails to publish is kept and retried on the next wake-up, every
second while any is kept, and at close: every transfer must be answered exactly once, or a
request would wait forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge

from services.worker.kv_offload.connector import KVConnector
from services.worker.kv_offload.head_shards import KVHeadShards
from services.worker.kv_offload.wiring import build_connector
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.step_thread import StepThread
from shared.bus import Bus
from shared.config import WorkerSettings
from shared.metrics import metric_name
from shared.protocol import KVTransferDone

log = logging.getLogger(__name__)

RETRY_UNSENT_S = 1.0

KV_TRANSFERS = Counter(
    metric_name("worker_kv_transfers_total"), "KV offload transfers finished", ["kind", "result"]
)
KV_TRANSFER_BYTES = Counter(
    metric_name("worker_kv_transfer_bytes_total"),
    "Payload bytes moved by successful KV offload transfers",
    ["kind"],
)
KV_DROPPED_STORES = Counter(
    metric_name("worker_kv_dropped_stores_total"),
    "Store chunks dropped because staging was full (the store thread is behind, e.g. a slow "
    "Redis): a step never waits for a store",
)
KV_TRANSFER_SECONDS = Counter(
    metric_name("worker_kv_transfer_seconds_total"),
    "Wall time of successful KV offload transfers (submitted to answered): bytes/s is the ratio",
    ["kind"],
)

KV_HOST_TIER_BYTES = Gauge(
    metric_name("worker_kv_host_tier_bytes"),
    "Payload bytes held by the worker's host-memory tier in front of Redis (an LRU bounded by "
    "MESHLLM_KV_HOST_TIER_BYTES): the worker's RSS grows by this much as it fills",
)


class KVTransferPump:
    def __init__(
        self,
        bus: Bus,
        results_stream: str,
        step_lock: asyncio.Lock,
        step_thread: StepThread | None = None,
    ) -> None:
        self.bus = bus
        self.results_stream = results_stream
        self.step_lock = step_lock
        self.step_thread = step_thread or StepThread("kv-apply")
        self.connector: KVConnector | None = None
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._unsent: list[KVTransferDone] = []
        self._dropped_counted = 0

    def wake(self) -> None:
        """Called from any thread when there is a load to apply or a message to publish."""
        self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            # Messages that failed to publish (Redis away) are retried every RETRY_UNSENT_S
            # too: after an outage, nothing else may ever wake the pump again.
            timeout = RETRY_UNSENT_S if self._unsent else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            await self.step()

    async def step(self) -> None:
        connector = self.connector
        if connector is None:
            return
        if connector.has_ready_loads():
            async with self.step_lock:
                await self.step_thread.run(connector.apply_ready_loads)
        await self.publish()

    async def publish(self) -> None:
        assert self.connector is not None
        dropped = self.connector.dropped_chunks  # counted when dropped, not when answered
        KV_DROPPED_STORES.inc(dropped - self._dropped_counted)
        self._dropped_counted = dropped
        self._unsent += self.connector.drain_done()
        if not self._unsent:
            return
        batch, self._unsent = self._unsent, []
        try:
            await self.bus.publish_many([(self.results_stream, done) for done in batch])
        except Exception:
            log.exception("publishing %d KVTransferDone failed; kept for the next try", len(batch))
            self._unsent = batch + self._unsent
            return
        for done in batch:
            KV_TRANSFERS.labels(done.kind, "ok" if done.ok else "failed").inc()
            if done.num_bytes:  # a store that dropped its tail still wrote its head
                KV_TRANSFER_BYTES.labels(done.kind).inc(done.num_bytes)
                KV_TRANSFER_SECONDS.labels(done.kind).inc(done.seconds)

    async def close(self) -> None:
        """Finish the queued transfers (their threads stop), then publish what is left."""
        if self.connector is not None:
            await asyncio.to_thread(self.connector.close)
            self.connector.reset()  # loads read but never copied in: reported failed
            await self.publish()


async def attach_kv_offload(
    settings: WorkerSettings,
    kv_cache: KVCache,
    config: Any,
    model_name: str,
    incarnation: str,
    bus: Bus,
    results_stream: str,
    step_lock: asyncio.Lock,
    step_thread: StepThread | None = None,
    shards: KVHeadShards | None = None,
    followers: Callable[[str, Any], None] | None = None,
) -> KVTransferPump:
    """A pump with its connector (call on the event loop); the caller sets the runner's
    `kv_connector` to `pump.connector` and runs `pump.run`.

    The connector is built on the step thread: its staging buffer is filled by torch ops that
    run in parallel, and a parallel op on any other thread gives that thread an OpenMP team of
    its own. With two teams in the process the OpenMP runtime stops spinning at barriers
    (more threads than cores), and every forward on a 2-core machine ran 1.5-2.5x slower with
    the tier on (runner/step_thread.py says why one team).

    Tensor parallelism: `shards` (the group's KV head split) and `followers` (a runner call to
    the other ranks) make this rank 0's connector of the group (connector.py); applying a
    load from here is then a group call, made on the step thread like every other."""
    pump = KVTransferPump(bus, results_stream, step_lock, step_thread)
    pump.connector = await pump.step_thread.run(
        build_connector,
        settings,
        kv_cache,
        config,
        model_name,
        incarnation,
        pump.wake,
        shards,
        followers,
    )
    host_tier = pump.connector.engine.host_tier
    KV_HOST_TIER_BYTES.set_function(lambda: host_tier.nbytes)
    return pump
