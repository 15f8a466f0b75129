"""The scheduler's I/O edge for the KV offload tier: kvstore calls, probes, transfer answers.

Around the pure connector (services/scheduler/offload), per step of the service's loop:
- `prepare(core, plan)` (after `schedule()`, before the plan is published): starts this step's
  lookup probes (one batch, as asyncio tasks; their answers wake the step loop), pins the
  plan's loads in the kvstore (`load`: a load whose chunks cannot all be pinned is failed at
  once, never sent), and asks the kvstore which offered chunks to write (`store`: `kv_stores`
  is trimmed to its `write` answer; present chunks are only recorded for recency);
- `on_step_result(step_id)` (from the results reader): that step's forward ended, so the
  worker is writing the stores it carried: the kvstore restarts their write deadline
  (`writing`), which then covers the writes only, never the prefill before them (a worker
  reset does the same for every step in flight: they will never report);
- `on_done(core, msg)` (from the results reader): a KVTransferDone. Loads go to the core
  (computed, or recompute with forced misses) and release their pins (`loaded`); stores are
  reported (`stored`, ok or not, per chunk) and their keys re-probed;
- finished requests (stop, abort, error) get the kvstore's `request_finished`, which commits
  the request's recency and releases any pin it still holds.

Reports run one at a time from a queue (`run()`), under the same lock as `prepare`'s calls, so
the kvstore sees each request's calls in order (its `store` before its `request_finished`).

The kvstore is called over the bus (kvstore_client, shared.rpc): `start()` opens the edge's
reply stream before the first call.

Failure policy: a kvstore that errs or times out (or is not on the bus at all) is skipped
(probes answer "miss", stores are dropped, loads are not started), counted in
`meshllm:kv_offload_errors_total{op}` and logged; requests then simply recompute. Nothing here
ever fails a request. The skip lasts until a ping answers: the first one `kvstore_retry_s`
after the failure, then one per `kvstore_retry_s`, in the background. So a dead kvstore costs
the step loop one timeout, not one per retry period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

from prometheus_client import Counter

from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector, StoreOffer
from services.scheduler.offload.kvstore_client import (
    KVStoreClient,
    KVStoreError,
    KVStoreRefused,
)
from services.scheduler.scheduler import Scheduler
from shared.bus import Bus
from shared.config import SchedulerSettings
from shared.kv.offload_key import LAYOUT_VERSION, KeySpace, OffloadKey
from shared.metrics import metric_name
from shared.protocol import KVTransfer, KVTransferDone, StepPlan, WorkerReady
from shared.rpc import RpcClient
from shared.streams import Streams

log = logging.getLogger(__name__)
T = TypeVar("T")

ERRORS = Counter(
    metric_name("kv_offload_errors"),
    "kvstore calls that failed (the offload tier was skipped: requests recompute)",
    ["op"],
)
QUERY_TOKENS = Counter(
    metric_name("external_prefix_cache_queries"),
    "Prompt tokens beyond the local prefix hit looked up in the offload tier",
)
HIT_TOKENS = Counter(
    metric_name("external_prefix_cache_hits"),
    "Prompt tokens loaded from the offload tier instead of computed",
)
LOADED_BYTES = Counter(metric_name("kv_offload_loaded_bytes"), "KV bytes loaded from the tier")
STORED_BYTES = Counter(metric_name("kv_offload_stored_bytes"), "KV bytes stored to the tier")
TRANSFERS = Counter(
    metric_name("kv_offload_transfers"), "KV transfers answered by the worker", ["kind", "result"]
)
MAX_PENDING_STORES = 100_000  # store transfers awaiting their answer (a dead worker never answers)


class OffloadEdge:
    def __init__(self, settings: SchedulerSettings, wake: Callable[[], None]) -> None:
        self.settings = settings
        self.wake = wake
        self.rpc: RpcClient | None = None
        self.kvstore_stream = ""
        self.client: KVStoreClient | None = None
        self.lookup: AsyncLookup | None = None
        self.connector: OffloadConnector | None = None
        self._lock = asyncio.Lock()
        # (op, call, then): `then` runs once the call was made or skipped
        self._reports: asyncio.Queue[
            tuple[str, Callable[[], Awaitable[Any]], Callable[[], None] | None]
        ] = asyncio.Queue()
        # store transfer id -> (request id, chunks written: (key, end, nbytes)), until answered
        self._stores: dict[str, tuple[str, list[tuple[OffloadKey, int, int]]]] = {}
        # request id -> its `stored` reports queued or in progress: until the kvstore has them,
        # its chunks still read "writing" there (a P/D handoff waits for them).
        self._stored_reports: dict[str, int] = {}
        # step id -> its store transfers whose writes have not begun (the step still runs)
        self._stores_in_step: dict[int, list[str]] = {}
        self._worker_incarnation = ""  # the core's, as of the last prepare
        self._down = False  # a call failed: skip the kvstore until a ping answers
        self._next_ping = 0.0  # monotonic time of the next ping while down
        self._ping: asyncio.Task[None] | None = None
        self.chunk_bytes = 0  # bytes per chunk: WorkerReady.kv_chunk_bytes, or store answers
        self._queries_seen = 0
        self.errors = 0

    # --- wiring ----------------------------------------------------------------------------

    async def start(self, bus: Bus, streams: Streams) -> None:
        """Open this scheduler's reply stream for kvstore answers (before any `attach`)."""
        self.rpc = RpcClient(
            bus,
            streams.rpc_replies("scheduler", self.settings.instance_id),
            streams.rpc_reply_prefix,
        )
        self.kvstore_stream = streams.calls("kvstore")
        await self.rpc.start()

    def attach(self, core: Scheduler, ready: WorkerReady, incarnation: str) -> None:
        """Give a (new) core its connector, in the key space of the worker's model."""
        assert self.rpc is not None, "start() first"
        if self.client is None or self.client.model != ready.model:
            self.client = KVStoreClient(
                self.rpc,
                self.kvstore_stream,
                ready.model,
                LAYOUT_VERSION,
                timeout_s=self.settings.kvstore_timeout_s,
            )
        self.lookup = AsyncLookup(self._probe)
        space = KeySpace(self.settings.cluster, ready.model, LAYOUT_VERSION)
        self.connector = OffloadConnector(
            core.config,
            space,
            self.lookup,
            f"{self.settings.instance_id}-{incarnation}",
            store=self.settings.role != "decode",
        )
        core.offload = self.connector
        self._queries_seen = 0
        self._stores_in_step.clear()  # a new core numbers its steps from 0
        if ready.kv_chunk_bytes:  # else learnt from the first store's answer
            self.chunk_bytes = ready.kv_chunk_bytes

    async def run(self, stopping: asyncio.Event) -> None:
        """Send queued reports, one at a time, until stopped."""
        while not stopping.is_set():
            op, call, then = await self._reports.get()
            try:
                async with self._lock:
                    await self._call(op, call)
            finally:
                if then is not None:
                    then()

    async def close(self) -> None:
        if self.lookup is not None:
            await self.lookup.close()
        if self._ping is not None:
            self._ping.cancel()
        if self.rpc is not None:
            await self.rpc.stop()

    def state(self) -> dict[str, Any]:
        c = self.connector
        return {
            "kvstore_stream": self.kvstore_stream,
            "available": not self._down,
            "errors": self.errors,
            "chunk_bytes": self.chunk_bytes,
            "pending_stores": len(self._stores),
            "loading": len(c.loading) if c else 0,
            "stats": vars(c.stats) if c else {},
            "lookup": self.lookup.counts() if self.lookup else {},
        }

    def stores_pending(self, request_id: str) -> bool:
        """Whether a store transfer of the request awaits the worker's answer (P/D: a prefill
        request is handed off once none does)."""
        if self._stored_reports.get(request_id):
            return True
        return any(rid == request_id for rid, _ in self._stores.values())

    # --- kvstore calls ---------------------------------------------------------------------

    def usable(self) -> bool:
        """Whether calls go out now. While down, pings the kvstore in the background once per
        `kvstore_retry_s` (never from the caller: a dead kvstore must not stall the step loop
        a timeout per retry)."""
        if not self._down:
            return True
        client = self.client
        if self._ping is None and client is not None and time.monotonic() >= self._next_ping:
            self._ping = asyncio.create_task(self._ping_kvstore(client), name="kvstore-ping")
        return False

    async def _ping_kvstore(self, client: KVStoreClient) -> None:
        try:
            await client.ping()
        except KVStoreError as exc:
            self._next_ping = time.monotonic() + self.settings.kvstore_retry_s
            log.info("kvstore still unreachable (%s); offload stays off", exc)
        else:
            self._down = False
            log.info("kvstore answers again: offload back on")
            self.wake()
        finally:
            self._ping = None

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """One kvstore call; None when skipped or failed (then the tier is skipped a while)."""
        if not self.usable():
            return None
        try:
            return await call()
        except KVStoreRefused as exc:  # this call only: the kvstore itself is fine
            ERRORS.labels(op=op).inc()
            self.errors += 1
            log.warning("kvstore %s refused (%s): skipped", op, exc)
            return None
        except (KVStoreError, TimeoutError, OSError) as exc:
            ERRORS.labels(op=op).inc()
            self.errors += 1
            self._down = True
            self._next_ping = time.monotonic() + self.settings.kvstore_retry_s
            log.warning(
                "kvstore %s failed (%s); offload off until the kvstore answers a ping "
                "(in %.1f s, then every %.1f s): requests recompute",
                op,
                exc,
                self.settings.kvstore_retry_s,
                self.settings.kvstore_retry_s,
            )
            return None

    def _report(
        self, op: str, call: Callable[[], Awaitable[Any]], then: Callable[[], None] | None = None
    ) -> None:
        self._reports.put_nowait((op, call, then))

    def _report_stored(self, request_id: str, call: Callable[[], Awaitable[Any]]) -> None:
        self._stored_reports[request_id] = self._stored_reports.get(request_id, 0) + 1

        def reported() -> None:
            left = self._stored_reports.pop(request_id) - 1
            if left:
                self._stored_reports[request_id] = left
            self.wake()

        self._report("stored", call, reported)

    async def _probe(self, keys: list[Any]) -> Collection[Any]:
        client = self.client
        if client is None:
            return set()
        found = await self._call("lookup", lambda: client.existing(keys))
        return found if found is not None else set()

    # --- per step --------------------------------------------------------------------------

    async def prepare(self, core: Scheduler, plan: StepPlan | None) -> None:
        connector, client = self.connector, self.client
        if connector is None or client is None or core.offload is not connector:
            return
        if core.worker_incarnation != self._worker_incarnation:
            # The worker restarted or was declared dead: the steps in flight will never report
            # ending, and their stores are written now or never: start their short deadline.
            self._worker_incarnation = core.worker_incarnation
            if self._stores_in_step:
                self.on_step_result(max(self._stores_in_step))
        for rid in connector.take_finished():
            self._report("request_finished", lambda rid=rid: client.request_finished(rid))
        assert self.lookup is not None
        for task in self.lookup.flush():
            task.add_done_callback(lambda _: self.wake())
        queried = connector.stats.external_query_tokens
        QUERY_TOKENS.inc(max(0, queried - self._queries_seen))
        self._queries_seen = queried
        if plan is None or not (plan.kv_loads or plan.kv_stores):
            return
        async with self._lock:
            if plan.kv_loads:
                plan.kv_loads = await self._pin_loads(core, connector, client, plan.kv_loads)
            if plan.kv_stores:
                plan.kv_stores = await self._admit_stores(connector, client, plan.kv_stores)
                if plan.kv_stores:
                    self._stores_in_step[plan.step_id] = [t.transfer_id for t in plan.kv_stores]

    async def _pin_loads(
        self,
        core: Scheduler,
        connector: OffloadConnector,
        client: KVStoreClient,
        loads: list[KVTransfer],
    ) -> list[KVTransfer]:
        sent = []
        for transfer in loads:
            request = connector.loading.get(transfer.transfer_id)
            state = connector.states.get(transfer.request_id)
            if request is None or state is None or state.load is None:
                continue  # finished (aborted) since it was planned: never sent
            reads = state.load.keys
            rid = transfer.request_id
            pinned = await self._call("load", lambda rid=rid, reads=reads: client.load(rid, reads))
            pinned_set = set(pinned or ())
            missing = [k for k, _ in reads if k not in pinned_set]
            if not missing:
                sent.append(transfer)
                continue
            # Evicted since the probe (or the kvstore is down): fail it before sending; the
            # request recomputes what the tier cannot give.
            if pinned:
                self._report("loaded", lambda rid=rid, keys=pinned: client.loaded(rid, keys))
            space = connector.space
            core.kv_load_done(transfer.transfer_id, False, [space.payload_key(k) for k in missing])
            TRANSFERS.labels(kind="load", result="unpinned").inc()
        return sent

    async def _admit_stores(
        self, connector: OffloadConnector, client: KVStoreClient, stores: list[KVTransfer]
    ) -> list[KVTransfer]:
        sent = []
        for transfer in stores:
            offer = connector.store_offers.pop(transfer.transfer_id, None)
            if offer is None:
                continue
            kept = await self._store_answer(client, offer, transfer)
            if kept is not None:
                sent.append(kept)
        if len(self._stores) > MAX_PENDING_STORES:  # answers that never came (the kvstore
            for tid in list(self._stores)[: len(self._stores) // 2]:  # expires those writes)
                del self._stores[tid]
            for step in list(self._stores_in_step)[: len(self._stores_in_step) // 2]:
                del self._stores_in_step[step]
        return sent

    async def _store_answer(
        self, client: KVStoreClient, offer: StoreOffer, transfer: KVTransfer
    ) -> KVTransfer | None:
        offers = [(key, end, self.chunk_bytes) for key, end in offer.chunks]
        rid = offer.request_id
        reply = await self._call("store", lambda: client.store(rid, offers))
        if reply is None or not reply.write:
            return None
        write = set(reply.write)
        keep = [i for i, (key, _) in enumerate(offer.chunks) if key in write]
        self._stores[transfer.transfer_id] = (rid, [offers[i] for i in keep])
        return KVTransfer(
            transfer_id=transfer.transfer_id,
            request_id=rid,
            keys=[transfer.keys[i] for i in keep],
            groups=[transfer.groups[i] for i in keep],
            block_ids=[transfer.block_ids[i] for i in keep],
        )

    # --- answers from the worker -----------------------------------------------------------

    def on_step_result(self, step_id: int) -> None:
        """Step `step_id` (and any before it) ended: the stores they carried are being written.
        Steps end in order, so every step up to this one is done."""
        client = self.client
        steps = [s for s in self._stores_in_step if s <= step_id]
        keys = [
            key
            for step in steps
            for tid in self._stores_in_step.pop(step)
            if tid in self._stores  # not answered already
            for key, _, _ in self._stores[tid][1]
        ]
        if client is not None and keys:
            self._report("writing", lambda: client.writing(keys))

    def on_done(self, core: Scheduler, msg: KVTransferDone) -> None:
        client = self.client
        if client is None or self.connector is None or core.offload is not self.connector:
            return
        result = "ok" if msg.ok else "failed"
        if msg.kind == "load":
            outcome = core.kv_load_done(msg.transfer_id, msg.ok, msg.failed_keys)
            if outcome is None:
                return  # voided by a reset: its pins went with the request's finish
            TRANSFERS.labels(kind="load", result=result).inc()
            if outcome.ok:
                LOADED_BYTES.inc(msg.num_bytes)
                HIT_TOKENS.inc(outcome.loaded_tokens)
            rid, keys = outcome.request_id, outcome.keys
            self._report("loaded", lambda: client.loaded(rid, keys))
        else:
            entry = self._stores.pop(msg.transfer_id, None)
            if entry is None:
                return
            TRANSFERS.labels(kind="store", result=result).inc()
            rid, chunks = entry
            space = self.connector.space
            failed = {space.parse(name) for name in msg.failed_keys} if msg.ok else None
            ok = [c for c in chunks if failed is not None and c[0] not in failed]
            bad = [c for c in chunks if failed is None or c[0] in failed]
            if ok:
                STORED_BYTES.inc(msg.num_bytes)
                if msg.num_bytes:  # the worker's bytes per chunk: offers carry it from now on
                    self.chunk_bytes = msg.num_bytes // len(ok)
                    ok = [(key, end, self.chunk_bytes) for key, end, _ in ok]
                self._report_stored(rid, lambda: client.stored(ok, True))
                assert self.lookup is not None
                self.lookup.invalidate([c[0] for c in ok])  # present now: ask again
            if bad:
                self._report_stored(rid, lambda: client.stored(bad, False))
        self.wake()
