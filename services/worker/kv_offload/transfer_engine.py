"""The background half of KV offload: a store thread and a load thread, each with a queue and
its own synchronous redis-py connection, and the host tier in front of Redis.

Why threads with a sync client rather than an asyncio task on the worker's loop: each job
does megabytes of memcpy (serialising staged blocks, assembling read payloads), waits on CUDA
events and uploads through pinned memory; on the event loop that work would stall the step
reader, the heartbeats and the admin app. In a thread it overlaps them: redis-py's socket I/O
and torch's copies release the GIL. One thread per direction, so a load (which a request waits
on) never queues behind a long store. The core (`KVConnector`) never sees Redis: it submits
jobs and receives `TransferOutcome`s through a callback.

Every job ends in exactly one outcome, whatever happens (Redis down, a bad payload, close()).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kernels.staged_copy import CopyFence, stage_to_device
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import (
    PayloadError,
    PayloadHeader,
    check_payload,
    pack_payload,
)
from shared.protocol import KVTransfer

log = logging.getLogger(__name__)

PIPELINE_BYTES = 16 * 2**20
"""A pipeline is flushed once it carries this many payload bytes: large transfers stream
instead of building one giant request (and one giant reply) in memory."""


@dataclass
class StoreJob:
    """Staged chunks of one store transfer: `bodies[j]` (a staging slot) goes to `keys[j]`."""

    transfer: KVTransfer
    keys: list[str]
    headers: list[PayloadHeader]
    bodies: list[torch.Tensor]
    fence: CopyFence | None
    release: Callable[[], None]  # gives the staging slots back
    started: float
    rejected_keys: list[str] = field(default_factory=list)  # chunks that were never staged
    rejected_reason: str | None = None


@dataclass
class LoadGroup:
    """The chunks of one load that belong to one KV cache group."""

    group: int
    header: PayloadHeader
    keys: list[str]
    block_ids: list[int]
    staged: torch.Tensor | None = None  # [n, *header.shape] on the cache's device, once read


@dataclass
class LoadJob:
    transfer: KVTransfer
    groups: list[LoadGroup]
    device: torch.device
    generation: int
    started: float


@dataclass
class TransferOutcome:
    """How a job ended. A load outcome with `ok` carries its chunks staged on the device."""

    job: StoreJob | LoadJob
    failed_keys: list[str] = field(default_factory=list)
    num_bytes: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed_keys and self.error is None


class TransferEngine:
    def __init__(
        self,
        redis_url: str,
        host_tier: HostTier,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        self.redis_url = redis_url
        self.host_tier = host_tier
        self.timeout_s = timeout_s
        self._queues: dict[str, queue.Queue[StoreJob | LoadJob | None]] = {
            "store": queue.Queue(),
            "load": queue.Queue(),
        }
        self._threads: list[threading.Thread] = []
        self._on_outcome: Callable[[TransferOutcome], None] | None = None
        self._closed = False
        self._submit_lock = threading.Lock()

    def _client(self) -> redis.Redis:
        # No retries: a failed transfer is reported and the scheduler recomputes; retrying
        # would only hold a staging slot (or a waiting request) longer.
        return redis.Redis.from_url(
            self.redis_url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def start(self, on_outcome: Callable[[TransferOutcome], None]) -> None:
        self._on_outcome = on_outcome
        for kind, run in (("store", self._store), ("load", self._load)):
            thread = threading.Thread(
                target=self._serve, args=(kind, run), name=f"kv-offload-{kind}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def submit(self, job: StoreJob | LoadJob) -> None:
        """Queue a job; after `close()` the job ends at once as failed (still answered)."""
        with self._submit_lock:  # a job queued behind the stop sentinel would never end
            if not self._closed:
                self._queues["store" if isinstance(job, StoreJob) else "load"].put(job)
                return
        if isinstance(job, StoreJob):
            job.release()
        assert self._on_outcome is not None
        self._on_outcome(TransferOutcome(job, list(job.transfer.keys), error="worker stopping"))

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs, then stop the threads."""
        with self._submit_lock:
            self._closed = True
            for q in self._queues.values():
                q.put(None)
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads.clear()

    def _serve(self, kind: str, run: Callable[[redis.Redis, Any], TransferOutcome]) -> None:
        client = self._client()
        jobs = self._queues[kind]
        try:
            while (job := jobs.get()) is not None:
                try:
                    outcome = run(client, job)
                except Exception as exc:  # never lose a job: it ends as a failed outcome
                    log.exception("KV %s of transfer %s failed", kind, job.transfer.transfer_id)
                    outcome = TransferOutcome(
                        job, list(job.transfer.keys), error=f"{type(exc).__name__}: {exc}"
                    )
                assert self._on_outcome is not None
                self._on_outcome(outcome)
        finally:
            client.close()

    # -- stores -----------------------------------------------------------------------------

    def _store(self, client: redis.Redis, job: StoreJob) -> TransferOutcome:
        try:
            if job.fence is not None:
                job.fence.synchronize()
            payloads = [pack_payload(h, b) for h, b in zip(job.headers, job.bodies, strict=True)]
        finally:
            job.release()  # the bytes are copied out: the slots may take the next store
        failed: list[str] = []
        error: str | None = None
        written = 0
        for batch in _batches(list(zip(job.keys, payloads, strict=True))):
            try:
                pipe = client.pipeline(transaction=False)
                for key, payload in batch:
                    pipe.set(key, payload)
                replies = pipe.execute(raise_on_error=False)
            except redis.RedisError as exc:
                error = f"{type(exc).__name__}: {exc}"
                failed.extend(key for key, _ in batch)
                continue
            for (key, payload), reply in zip(batch, replies, strict=True):
                if isinstance(reply, Exception):
                    error = f"{type(reply).__name__}: {reply}"
                    failed.append(key)
                else:
                    written += len(payload)
                    self.host_tier.put(key, payload)
        return TransferOutcome(job, failed, written, error)

    # -- loads ------------------------------------------------------------------------------

    def _load(self, client: redis.Redis, job: LoadJob) -> TransferOutcome:
        keys = [key for group in job.groups for key in group.keys]
        payloads, from_redis, error = self._read(client, keys)
        failed: list[str] = []
        errors: list[str] = [error] if error else []
        offsets: dict[str, int] = {}
        headers = {key: group.header for group in job.groups for key in group.keys}
        for key in keys:
            payload = payloads.get(key)
            if payload is None:
                failed.append(key)
                continue
            try:
                offsets[key] = check_payload(payload, headers[key])
            except PayloadError as exc:
                failed.append(key)
                errors.append(f"{key}: {exc}")
        if failed:
            missing = [k for k in failed if payloads.get(k) is None]
            if missing and not error:
                errors.append(f"{len(missing)} chunk(s) missing, first {missing[0]}")
            return TransferOutcome(job, failed, 0, "; ".join(errors[:3]))
        for key in from_redis:  # validated: a chunk read once is likely read again here
            self.host_tier.put(key, payloads[key])
        num_bytes = 0
        for group in job.groups:
            host = torch.empty((len(group.keys), *group.header.shape), dtype=group.header.dtype)
            rows = host.view(torch.uint8).numpy().reshape(len(group.keys), -1)
            for j, key in enumerate(group.keys):
                rows[j] = np.frombuffer(payloads[key], np.uint8, rows.shape[1], offsets[key])
            # Read payloads -> pinned staging -> asynchronous copy to the device (the one
            # helper); the step thread later scatters this tensor into the blocks. A CPU cache
            # has no device to upload to, and the helper's copy would be a plain second copy.
            cpu = job.device.type == "cpu"
            group.staged = host if cpu else stage_to_device(host, job.device)
            num_bytes += sum(len(payloads[key]) for key in group.keys)
        return TransferOutcome(job, [], num_bytes)

    def _read(
        self, client: redis.Redis, keys: list[str]
    ) -> tuple[dict[str, bytes], list[str], str | None]:
        """Payloads by key (absent keys left out): the host tier first, the rest in one
        pipelined GET batch; also the keys that came from Redis, and a Redis error if any."""
        found: dict[str, bytes] = {}
        remote: list[str] = []
        for key in keys:
            value = self.host_tier.get(key)
            if value is None:
                remote.append(key)
            else:
                found[key] = value
        if not remote:
            return found, [], None
        try:
            pipe = client.pipeline(transaction=False)
            for key in remote:
                pipe.get(key)
            values = pipe.execute()
        except redis.RedisError as exc:
            return found, [], f"{type(exc).__name__}: {exc}"
        from_redis = []
        for key, value in zip(remote, values, strict=True):
            if value is not None:
                found[key] = value
                from_redis.append(key)
        return found, from_redis, None


def _batches(items: list[tuple[str, bytes]]) -> list[list[tuple[str, bytes]]]:
    batches: list[list[tuple[str, bytes]]] = [[]]
    size = 0
    for item in items:
        if batches[-1] and size + len(item[1]) > PIPELINE_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += len(item[1])
    return batches


def elapsed_since(started: float) -> float:
    return max(0.0, time.perf_counter() - started)
