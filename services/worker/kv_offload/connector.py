"""The worker side of KV offload as the model runner sees it: three calls around a step.

- `before_forward(plan)`: copies the loads that finished reading into their blocks (on the step
  thread, so never concurrently with a forward that may touch the KV cache), then hands the
  plan's `kv_loads` to the load thread;
- `after_forward(plan)`: copies the plan's `kv_stores` blocks into host staging before
  returning (the scheduler may reuse the blocks from the next plan on), and hands them to the
  store thread. It never waits: chunks that find no free staging slot are dropped (their store
  answers them failed, "dropped: staging full"; `dropped_chunks` counts them);
- `drain_done()`: the `KVTransferDone` messages ready to publish (the service publishes them,
  also between steps: `notify` is called whenever there is something to drain or to apply,
  and `apply_ready_loads()` runs a finished load while the worker idles).

Invariants: every transfer of a plan ends in exactly one KVTransferDone; a load is all or
nothing (ok only when every chunk was read, validated and copied into its block); a load is
reported done only after its copy into the KV cache; `reset()` (a failed step, a new
scheduler) drops every load not yet copied and every store not yet staged, reporting them
failed. No Redis here: the `TransferEngine` owns the I/O.

Tensor parallelism (MESHLLM_TP=N): this connector runs on rank 0, the only rank with Redis;
ranks 1..N-1 run a `KVFollower` (group_blocks.py). Payloads keep the one full-head layout of a
TP=1 worker (head_shards.py says why), so the headers name every KV head of the model. A store
gathers each rank's heads of its chunks to rank 0 inside the step every rank runs (the
followers find the same chunks in the same plan). A load is read by rank 0 alone; applying it
is a collective the followers must join, so it never happens inside a step (they could not
know which loads finished reading): rank 0 first sends them the loads' blocks over the
command pipe (`followers`), then every rank writes its heads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from meshllm_kernels.runtime.staged_copy import CopyFence
from services.worker.kv_offload.chunks import Chunk
from services.worker.kv_offload.group_blocks import GroupKVBlocks
from services.worker.kv_offload.head_shards import KVHeadShards
from services.worker.kv_offload.payload import LAYOUT_VERSION, PayloadHeader
from services.worker.kv_offload.staging import StagingPool, gather_blocks, stage_chunks
from services.worker.kv_offload.store_job import StoreJob, StorePiece
from services.worker.kv_offload.transfer_engine import (
    LoadGroup,
    LoadJob,
    TransferEngine,
    TransferOutcome,
)
from services.worker.runner.kv_cache import KVCache
from shared.kv.offload_key import KeySpace
from shared.protocol import KVTransfer, KVTransferDone, StepPlan

DROPPED_STAGING_FULL = "dropped: staging full"  # the scheduler counts errors "dropped: ..."


class KVConnector:
    def __init__(
        self,
        kv_cache: KVCache,
        engine: TransferEngine,
        key_space: KeySpace,
        *,
        worker_id: str,
        worker_incarnation: str = "",
        layer_groups: list[list[int]] | None = None,
        staging_bytes: int = 64 * 2**20,
        notify: Callable[[], None] | None = None,
        shards: KVHeadShards | None = None,
        followers: Callable[[str, Any], None] | None = None,
    ) -> None:
        if key_space.layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"key space layout version {key_space.layout_version} != payload layout "
                f"version {LAYOUT_VERSION}"
            )
        self.kv_cache = kv_cache
        self.engine = engine
        self.key_space = key_space
        self.worker_id = worker_id
        self.worker_incarnation = worker_incarnation
        self.notify = notify or (lambda: None)
        groups = layer_groups or [list(range(len(kv_cache.layers)))]
        first = kv_cache.layers[groups[0][0]]  # an attention layer's K/V tensor
        assert isinstance(first, torch.Tensor), "KV offload groups hold attention layers only"
        if shards is None:  # one rank: it holds every head
            shards = KVHeadShards.of_heads(first.shape[3])
        if shards.sharded and followers is None:
            raise ValueError("a sharded connector needs the followers' command pipe")
        self.followers = followers
        self.blocks = GroupKVBlocks(kv_cache, key_space, shards, groups)
        self.group_layers = self.blocks.group_layers
        self.device = first.device
        self.headers = [
            PayloadHeader(key_space.model, self.blocks.group_dtype(g), self.blocks.chunk_shape(g))
            for g in range(len(groups))
        ]
        pinned = self.device.type == "cuda"
        self.pools = [
            StagingPool.sized(h, staging_bytes // len(groups), pinned) for h in self.headers
        ]
        self.dropped_chunks = 0  # store chunks that found no staging slot
        self._lock = threading.Lock()
        self._generation = 0
        self._ready: list[TransferOutcome] = []  # loads read and staged, not yet copied in
        self._pending_stores: list[KVTransfer] = []  # this step's stores, staged after forward
        self._done: deque[KVTransferDone] = deque()
        engine.start(self._on_outcome)

    # -- the model runner's calls -----------------------------------------------------------

    def before_forward(self, plan: StepPlan) -> None:
        if not self.blocks.shards.sharded:  # sharded: the service applies them first
            self.apply_ready_loads()
        for transfer in plan.kv_loads:
            self._submit_load(transfer)
        self._pending_stores.extend(plan.kv_stores)

    def after_forward(self, plan: StepPlan) -> None:
        stores, self._pending_stores = self._pending_stores, []
        for transfer in stores:
            self._submit_store(transfer)

    def reset(self) -> None:
        with self._lock:
            self._generation += 1
            ready, self._ready = self._ready, []
        for outcome in ready:
            self._finish(outcome.job.transfer, "load", outcome.job.started, error="worker reset")
        stores, self._pending_stores = self._pending_stores, []
        for transfer in stores:
            self._finish(transfer, "store", time.perf_counter(), error="step failed")

    # -- the service's calls ----------------------------------------------------------------

    def apply_ready_loads(self) -> int:
        """Copy every finished read into its blocks and report it; returns how many. Call only
        where no forward runs (the step thread, or the service holding the step lock), and,
        under tensor parallelism, where every runner call is made (it is a group call)."""
        with self._lock:
            ready, self._ready = self._ready, []
        loads = [outcome.job for outcome in ready if isinstance(outcome.job, LoadJob)]
        if loads and self.blocks.shards.sharded:  # the followers join the collectives below
            assert self.followers is not None
            self.followers("kv_load", [[(g.group, g.block_ids) for g in j.groups] for j in loads])
        for outcome in ready:
            job = outcome.job
            assert isinstance(job, LoadJob)
            for group in job.groups:
                assert group.staged is not None
                self.blocks.insert(group.group, group.block_ids, group.staged)
                group.staged = None
            self._finish(job.transfer, "load", job.started, num_bytes=outcome.num_bytes)
        return len(ready)

    @property
    def chunk_bytes(self) -> int:
        """Payload bytes of one chunk (header + body; the largest attention group's): what the
        scheduler offers the kvstore per chunk before any store has answered (WorkerReady).
        State chunks (P/D only, one per handed-over prompt) are left out."""
        return max(
            pool.payload_bytes for g, pool in enumerate(self.pools) if not self.blocks.is_state(g)
        )

    def has_ready_loads(self) -> bool:
        return bool(self._ready)

    def drain_done(self) -> list[KVTransferDone]:
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def close(self) -> None:
        self.engine.close()

    # -- submission -------------------------------------------------------------------------

    def _submit_load(self, transfer: KVTransfer) -> None:
        started = time.perf_counter()
        chunks, failed, reason = self.blocks.check.split(transfer)
        if failed:  # all or nothing: no chunk is read when one cannot be placed
            self._finish(transfer, "load", started, failed, error=reason)
            return
        by_group: dict[int, LoadGroup] = {}
        for key, group, block in chunks:
            load = by_group.setdefault(group, LoadGroup(group, self.headers[group], [], []))
            load.keys.append(key)
            load.block_ids.append(block)
        job = LoadJob(transfer, list(by_group.values()), self.device, self._generation, started)
        self.engine.submit(job)

    def _submit_store(self, transfer: KVTransfer) -> None:
        """Stage the transfer's blocks before returning (the next plan may reuse them): per
        group, its head chunks into the free slots, the rest dropped (see store_job). Sharded,
        every valid chunk is gathered whatever the slots (the followers cannot know them)."""
        started = time.perf_counter()
        groups, failed, reason = self.blocks.store_groups(transfer)
        job = StoreJob(transfer, started)
        if failed:
            job.reject(failed, reason or "invalid chunk")
        for group, group_chunks in groups.items():
            pool = self.pools[group]
            slots = pool.acquire(len(group_chunks))
            if len(slots) < len(group_chunks):  # the store side is behind: drop, never wait
                dropped = [key for key, _, _ in group_chunks[len(slots) :]]
                self.dropped_chunks += len(dropped)
                job.reject(dropped, DROPPED_STAGING_FULL)
            fence = self._stage(group, group_chunks, pool, slots)
            if not slots:
                continue
            staged = group_chunks[: len(slots)]
            job.add_piece()
            self.engine.submit(
                StorePiece(
                    job,
                    [key for key, _, _ in staged],
                    [pool.payload(slot) for slot in slots],
                    fence,
                    partial(pool.release, slots),
                )
            )
        self.engine.seal(job)

    def _stage(
        self, group: int, chunks: list[Chunk], pool: StagingPool, slots: list[int]
    ) -> CopyFence | None:
        """The head `len(slots)` chunks into `slots` (a collective when sharded)."""
        block_ids = [block for _, _, block in chunks]
        if self.blocks.shards.sharded:
            whole = self.blocks.gather(group, block_ids)
            assert whole is not None  # rank 0
            return stage_chunks(whole, pool, slots) if slots else None
        if not slots:
            return None
        if self.blocks.is_state(group):
            states = self.blocks.gather(group, block_ids[: len(slots)])
            assert states is not None
            return stage_chunks(states, pool, slots)
        return gather_blocks(self.group_layers[group], block_ids[: len(slots)], pool, slots)

    # -- completion -------------------------------------------------------------------------

    def _on_outcome(self, outcome: TransferOutcome) -> None:
        """Called on the engine's threads."""
        job = outcome.job
        if isinstance(job, StoreJob):
            failed = job.rejected_keys + outcome.failed_keys
            self._finish(
                job.transfer,
                "store",
                job.started,
                failed,
                outcome.num_bytes,
                job.rejected_reason or outcome.error or ("store failed" if failed else None),
            )
            return
        if outcome.ok:
            with self._lock:
                if job.generation == self._generation:
                    self._ready.append(outcome)
                    ready = True
                else:
                    ready = False
            if ready:
                self.notify()
                return
            outcome.error = "worker reset"
        failed = outcome.failed_keys or list(job.transfer.keys)
        self._finish(job.transfer, "load", job.started, failed, error=outcome.error)

    def _finish(
        self,
        transfer: KVTransfer,
        kind: str,
        started: float,
        failed_keys: list[str] | None = None,
        num_bytes: int = 0,
        error: str | None = None,
    ) -> None:
        if error is not None and not failed_keys:
            failed_keys = list(transfer.keys)
        ok = error is None and not failed_keys
        self._done.append(
            KVTransferDone(
                worker_id=self.worker_id,
                worker_incarnation=self.worker_incarnation,
                transfer_id=transfer.transfer_id,
                request_id=transfer.request_id,
                kind=kind,  # type: ignore[arg-type]
                ok=ok,
                failed_keys=failed_keys or [],
                num_bytes=num_bytes,
                seconds=max(0.0, time.perf_counter() - started),
                error=error,
            )
        )
        self.notify()
