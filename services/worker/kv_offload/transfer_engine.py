"""The background half of KV offload: a store thread and a load thread, each with a queue and
its own synchronous redis-py connection, and the host tier in front of Redis.

Why threads with a sync client rather than an asyncio task on the worker's loop: each job
moves megabytes, waits on CUDA events and uploads through pinned memory; on the event loop that
work would stall the step reader, the heartbeats and the admin app. In a thread it overlaps
them: socket I/O and torch's copies release the GIL. One thread per direction, so a load (which
a request waits on) never queues behind a long store.

The store thread is built to take as little from the model's threads as possible (on a 2-core
CPU machine every cycle it takes is a cycle the forward loses):
- no serialising: a piece's payloads are memoryviews of its staging slots (header included),
  sent to the socket as they are (redis-py's pure-Python command packer passes memoryviews
  through; the hiredis one would copy each payload twice, holding the GIL);
- batching: every piece waiting when the thread wakes goes into one pipelined round trip;
- a bounded busy share (`max_busy_share`): after each round trip the thread rests in
  proportion to the time it took, so stores never take more than that share of wall time,
  whatever the backlog. Stores then wait in their staging slots; when those are all taken,
  new stores are dropped by the step thread (never queued in memory, never waited for).
The core (`KVConnector`) never sees Redis: it submits jobs and receives `TransferOutcome`s
through a callback.

Every job ends in exactly one outcome, whatever happens (Redis down, a bad payload, close()).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import redis
import torch
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from meshllm_kernels.runtime.staged_copy import stage_to_device
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import PayloadError, PayloadHeader, check_payload
from services.worker.kv_offload.store_job import StoreJob, StorePiece
from shared.protocol import KVTransfer

log = logging.getLogger(__name__)

PIPELINE_BYTES = 16 * 2**20
"""A pipeline is flushed once it carries this many payload bytes: large transfers stream
instead of building one giant request (and one giant reply) in memory."""
BUFFER_CUTOFF = 6000  # redis-py's default: arguments longer than this are sent unjoined


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
        max_busy_share: float = 1.0,
    ) -> None:
        if not 0 < max_busy_share <= 1:
            raise ValueError(f"max_busy_share must be in (0, 1], got {max_busy_share}")
        self.redis_url = redis_url
        self.host_tier = host_tier
        self.timeout_s = timeout_s
        self.max_busy_share = max_busy_share
        self._pieces: queue.Queue[StorePiece | None] = queue.Queue()
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._on_outcome: Callable[[TransferOutcome], None] | None = None
        self._closed = False
        self._closing = threading.Event()  # ends the store thread's rest: close() drains
        self._submit_lock = threading.Lock()
        self.busy_s = 0.0  # time the store thread spent writing (its share is bounded)
        self.rested_s = 0.0  # time it rested to keep that share

    def _client(self, *, zero_copy: bool = False) -> redis.Redis:
        # No retries: a failed transfer is reported and the scheduler recomputes; retrying
        # would only hold a staging slot (or a waiting request) longer.
        options: dict[str, object] = {}
        if zero_copy:  # memoryview payloads go to the socket as they are
            encode = Encoder("utf-8", "strict", False).encode
            options["command_packer"] = PythonRespSerializer(BUFFER_CUTOFF, encode)
        return redis.Redis.from_url(
            self.redis_url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            **options,  # type: ignore[arg-type]
        )

    def start(self, on_outcome: Callable[[TransferOutcome], None]) -> None:
        self._on_outcome = on_outcome
        for name, target in (
            ("kv-offload-store", self._write_pieces),
            ("kv-offload-load", self._serve_loads),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, job: StorePiece | LoadJob) -> None:
        """Queue a load or a store piece; after `close()` it ends at once as failed (a load is
        still answered; a piece counts as failed in its store, answered when sealed)."""
        with self._submit_lock:  # a job queued behind the stop sentinel would never end
            if not self._closed:
                if isinstance(job, StorePiece):
                    self._pieces.put(job)
                else:
                    self._loads.put(job)
                return
        if isinstance(job, StorePiece):
            job.release()
            self._piece_done(job.job, list(job.keys), 0, "worker stopping")
            return
        self._emit(TransferOutcome(job, list(job.transfer.keys), error="worker stopping"))

    def seal(self, job: StoreJob) -> None:
        """Every piece of `job` was submitted: it is answered once the last one is done."""
        if job.seal():
            self._emit(TransferOutcome(job, job.failed_keys, job.written, job.error))

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs, then stop the threads."""
        with self._submit_lock:
            self._closed = True
            self._closing.set()
            self._pieces.put(None)
            self._loads.put(None)
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads.clear()

    def _emit(self, outcome: TransferOutcome) -> None:
        assert self._on_outcome is not None
        self._on_outcome(outcome)

    def _piece_done(
        self, job: StoreJob, failed: list[str], written: int, error: str | None
    ) -> None:
        if job.piece_done(failed, written, error):
            self._emit(TransferOutcome(job, job.failed_keys, job.written, job.error))

    def _serve_loads(self) -> None:
        client = self._client()
        try:
            while (job := self._loads.get()) is not None:
                try:
                    outcome = self._load(client, job)
                except Exception as exc:  # never lose a job: it ends as a failed outcome
                    log.exception("KV load of transfer %s failed", job.transfer.transfer_id)
                    outcome = TransferOutcome(
                        job, list(job.transfer.keys), error=f"{type(exc).__name__}: {exc}"
                    )
                self._emit(outcome)
        finally:
            client.close()

    # -- stores -----------------------------------------------------------------------------

    def _write_pieces(self) -> None:
        """Write every piece waiting (one pipelined round trip for all of them), give their
        slots back, rest to keep the busy share; until the stop sentinel."""
        client = self._client(zero_copy=True)
        try:
            stopping = False
            while not stopping:
                piece = self._pieces.get()
                if piece is None:
                    break
                batch = [piece]
                size = piece.nbytes
                while size < PIPELINE_BYTES:
                    try:
                        more = self._pieces.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stopping = True
                        break
                    batch.append(more)
                    size += more.nbytes
                started = time.perf_counter()
                self._write_batch(client, batch)
                busy = time.perf_counter() - started
                self.busy_s += busy
                if self.max_busy_share < 1 and not stopping and not self._closing.is_set():
                    rest = busy * (1 / self.max_busy_share - 1)
                    self.rested_s += rest
                    self._closing.wait(rest)
        finally:
            client.close()

    def _write_batch(self, client: redis.Redis, batch: list[StorePiece]) -> None:
        """Every piece of `batch` ends exactly once (written, failed), its slots released."""
        results: list[tuple[list[str], int, str | None]] = []
        try:
            for piece in batch:
                if piece.fence is not None:
                    piece.fence.synchronize()
            items = [
                (key, payload)
                for piece in batch
                for key, payload in zip(piece.keys, piece.payloads, strict=True)
            ]
            failed, error = self._store(client, items)
            for piece in batch:
                lost = [key for key in piece.keys if key in failed]
                written = sum(
                    p.nbytes for key, p in zip(piece.keys, piece.payloads, strict=True)
                    if key not in failed
                )  # fmt: skip
                results.append((lost, written, error if lost else None))
        except Exception as exc:  # never lose a piece: it ends as failed
            log.exception("KV store of %d piece(s) failed", len(batch))
            error = f"{type(exc).__name__}: {exc}"
            results = [(list(piece.keys), 0, error) for piece in batch]
        finally:
            for piece in batch:
                piece.release()  # the bytes are in Redis (or lost): the slots take new chunks
        for piece, (lost, written, err) in zip(batch, results, strict=True):
            self._piece_done(piece.job, lost, written, err)

    def _store(
        self, client: redis.Redis, items: list[tuple[str, memoryview]]
    ) -> tuple[set[str], str | None]:
        """One SET per chunk, pipelined; returns the failed keys and an error. Written payloads
        also go to the host tier (a copy: the slot is reused)."""
        failed: set[str] = set()
        error: str | None = None
        for batch in _batches(items):
            try:
                pipe = client.pipeline(transaction=False)
                for key, payload in batch:
                    pipe.set(key, payload)
                replies = pipe.execute(raise_on_error=False)
            except redis.RedisError as exc:
                error = f"{type(exc).__name__}: {exc}"
                failed.update(key for key, _ in batch)
                continue
            for (key, payload), reply in zip(batch, replies, strict=True):
                if isinstance(reply, Exception):
                    error = f"{type(reply).__name__}: {reply}"
                    failed.add(key)
                elif self.host_tier.capacity_bytes:
                    self.host_tier.put(key, bytes(payload))
        return failed, error

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


def _batches(items: list[tuple[str, memoryview]]) -> list[list[tuple[str, memoryview]]]:
    batches: list[list[tuple[str, memoryview]]] = [[]]
    size = 0
    for item in items:
        if batches[-1] and size + item[1].nbytes > PIPELINE_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item[1].nbytes
    return batches
