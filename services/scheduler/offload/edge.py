"""The scheduler's I/O edge for the KV offload tier: kvstore calls, probes, transfer answers.

Nothing here holds a plan back: the step loop never waits for the kvstore (a kvstore call is a
bus round trip, and a busy kvstore on the same cores made every plan wait behind the reports
queued before it). Per step of the service's loop:
- `prepare(core, plan)` (after `schedule()`, before the plan is published): starts this step's
  lookup probes (one batch, as asyncio tasks; their answers wake the step loop) and queues the
  plan's kvstore calls: the pins of its loads (`load`), and each request's store offers
  (`store`: the chunks its transfer writes, and the chunks in the tier already, reported for the
  request's recency). The plan goes out at once: a load is read whether or not its pin landed
  first (a chunk evicted meanwhile fails the load, which recomputes), and a store's chunks are
  written by the worker while the kvstore admits them;
- `on_step_result(step_id)` (from the results reader): that step's forward ended, so the
  worker is writing the stores it carried: the kvstore restarts their write deadline
  (`writing`), which then covers the writes only, never the prefill before them (a worker
  reset does the same for every step in flight: they will never report);
- `on_done(core, msg)` (from the results reader): a KVTransferDone. Loads go to the core
  (computed, or recompute with forced misses), teach the cost model the tier's bandwidth and
  release their pins (`loaded`); stores are reported (`stored`, ok or not, per chunk) and their
  keys re-probed;
- finished requests (stop, abort, error) get the kvstore's `request_finished`, which commits
  the request's recency and releases any pin it still holds.

Calls run one at a time from one queue (`run()`), so the kvstore sees each request's calls in
order: its `store` before the `writing` and `stored` of those chunks, its `load` before its
`loaded`, everything before its `request_finished`.

No payload without its metadata: a written chunk is always reported `stored`, whatever the
kvstore answered to its `store`. The kvstore makes it ready if it took the chunk, and deletes
the payload if it did not (no room: refused; or it was evicted meanwhile), so a write that
raced the kvstore's answer leaves nothing unaccounted for. A chunk the kvstore wants written
that this scheduler did not write (it believed the tier held it) is reported failed at once.

The kvstore is called over the bus (kvstore_client, shared.rpc): `start()` opens the edge's
reply stream before the first call.

Failure policy: a kvstore that errs or times out (or is not on the bus at all) is skipped
(probes answer "miss", stores are dropped from the plans, loads are not started), counted in
`meshllm:kv_offload_errors_total{op}` and logged; requests then simply recompute. Nothing here
ever fails a request. The skip lasts until a ping answers: the first one `kvstore_retry_s`
after the failure, then one per `kvstore_retry_s`, in the background. So a dead kvstore costs
the queue one timeout, not one per retry period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import Counter

from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector, StoreOffer
from services.scheduler.offload.kvstore_client import (
    KVStoreClient,
    KVStoreError,
    KVStoreRefused,
    StoreReply,
)
from services.scheduler.offload.load_cost import LoadCostModel
from services.scheduler.offload.store_admission import StoreAdmission
from services.scheduler.offload.verdict import Verdict
from services.scheduler.scheduler import Scheduler
from shared.bus import Bus
from shared.config import SchedulerSettings
from shared.kv.offload_key import LAYOUT_VERSION, KeySpace, OffloadKey
from shared.metrics import metric_name
from shared.protocol import KVTransferDone, StepPlan, WorkerReady
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
LOADS = Counter(
    metric_name("kv_offload_loads"),
    "Load decisions: a hit loaded (load) or recomputed because its load would be slower "
    "(compute), or a request not looked up because even a full hit would be (no_lookup)",
    ["decision"],
)
STORE_OFFERS = Counter(
    metric_name("kv_offload_store_offers"),
    "Chunks offered for store by the store policy's decision: written, recorded (in the tier "
    "already) or skipped (not likely to be read again)",
    ["decision"],
)
DROPPED_STORES = Counter(
    metric_name("kv_offload_dropped_stores"),
    "Chunks whose store was dropped (the worker's staging or Redis backlog was full, or the "
    "kvstore was unavailable); the step loop never waits for a store",
)
MAX_PENDING_STORES = 100_000  # store transfers awaiting their answer (a dead worker never answers)
MAX_QUEUED_CALLS = 10_000  # past this, new store offers are dropped (a kvstore that lags)


@dataclass
class _Store:
    """A store transfer in flight: its request, the chunks the worker writes (with their
    nbytes) and, once the kvstore answered the offer, its answer."""

    request_id: str
    chunks: list[tuple[OffloadKey, int, int]]
    reply: StoreReply | None = None


class OffloadEdge:
    def __init__(self, settings: SchedulerSettings, wake: Callable[[], None]) -> None:
        self.settings = settings
        self.wake = wake
        self.rpc: RpcClient | None = None
        self.kvstore_stream = ""
        self.client: KVStoreClient | None = None
        self.lookup: AsyncLookup | None = None
        self.connector: OffloadConnector | None = None
        # The policy and the cost model outlive a core (a worker of another shape).
        self.admission = StoreAdmission(
            "always" if settings.role == "prefill" else settings.kv_store_policy
        )
        self.cost = LoadCostModel(load_bytes_per_s=settings.kv_load_bytes_per_s)
        self._calls: asyncio.Queue[tuple[str, Callable[[], Awaitable[None]]]] = asyncio.Queue()
        # store transfer id -> what it writes, until the worker answers it
        self._stores: dict[str, _Store] = {}
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
        self._counted: dict[str, int] = {}  # metric name -> the connector count exported
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
        self.lookup = AsyncLookup(self._probe, max_pending_s=self.settings.kv_pending_write_wait_s)
        space = KeySpace(self.settings.cluster, ready.model, LAYOUT_VERSION)
        if ready.kv_chunk_bytes:  # else learnt from the first store's answer
            self.chunk_bytes = ready.kv_chunk_bytes
        self.connector = OffloadConnector(
            core.config,
            space,
            self.lookup,
            f"{self.settings.instance_id}-{incarnation}",
            store=self.settings.role != "decode",
            store_admission=self.admission,
            cost=self.cost,
            chunk_bytes=self.chunk_bytes,
            # P/D hands a hybrid's state groups over; prefix caching stays attention-only.
            transfer_state=self.settings.role != "both",
        )
        core.offload = self.connector
        self._counted.clear()
        self._stores_in_step.clear()  # a new core numbers its steps from 0

    async def run(self, stopping: asyncio.Event) -> None:
        """Make the queued kvstore calls, one at a time, in order, until stopped."""
        while not stopping.is_set():
            _, call = await self._calls.get()
            await call()

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
            "queued_calls": self._calls.qsize(),
            "loading": len(c.loading) if c else 0,
            "stats": vars(c.stats) if c else {},
            "store_policy": self.admission.policy,
            "store_decisions": vars(self.admission.stats),
            "load_cost": {**self.cost.state(), **vars(self.cost.stats)},
            "lookup": self.lookup.counts() if self.lookup else {},
        }

    def stores_pending(self, request_id: str) -> bool:
        """Whether a store transfer of the request awaits the worker's answer (P/D: a prefill
        request is handed off once none does)."""
        if self._stored_reports.get(request_id):
            return True
        return any(store.request_id == request_id for store in self._stores.values())

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

    def _queue(self, op: str, call: Callable[[], Awaitable[Any]]) -> None:
        """Queue a call whose answer nobody waits for."""

        async def run() -> None:
            await self._call(op, call)

        self._calls.put_nowait((op, run))

    def _queue_stored(
        self,
        request_id: str,
        chunks: list[tuple[OffloadKey, int, int]],
        ok: bool,
        store: _Store | None = None,
    ) -> None:
        """Report `chunks` written (ok) or failed. A failure is reported only for the chunks the
        kvstore reserved for this store (per its answer to `store`, which is known when this
        runs: the calls are queued in order); another writer's reservation is not this one's."""
        self._stored_reports[request_id] = self._stored_reports.get(request_id, 0) + 1
        client = self.client
        assert client is not None

        async def run() -> None:
            try:
                report = chunks
                reply = store.reply if store is not None else None
                if not ok:
                    reserved = set(reply.write) if reply is not None else set()
                    report = [c for c in chunks if c[0] in reserved]
                elif reply is not None and reply.refused:  # written, but deleted now
                    self.admission.mark_missing(reply.refused)
                if report:
                    await self._call("stored", lambda: client.stored(report, ok))
            finally:
                left = self._stored_reports.pop(request_id) - 1
                if left:
                    self._stored_reports[request_id] = left
                self.wake()

        self._calls.put_nowait(("stored", run))

    async def _probe(self, keys: list[Any]) -> Mapping[Any, Verdict]:
        client = self.client
        if client is None:
            return {}
        found = await self._call("lookup", lambda: client.verdicts(keys))
        return found if found is not None else {}

    # --- per step --------------------------------------------------------------------------

    async def prepare(self, core: Scheduler, plan: StepPlan | None) -> None:
        """Queue the kvstore calls of `plan` and start the step's probes; never waits for the
        kvstore (see the module docstring)."""
        connector, client = self.connector, self.client
        if connector is None or client is None or core.offload is not connector:
            return
        if core.worker_incarnation != self._worker_incarnation:
            # The worker restarted or was declared dead: the steps in flight will never report
            # ending, and their stores are written now or never: start their short deadline.
            self._worker_incarnation = core.worker_incarnation
            if self._stores_in_step:
                self.on_step_result(max(self._stores_in_step))
        connector.chunk_bytes = self.chunk_bytes
        offers = connector.take_store_offers()  # before the finishes: a request's order
        if plan is not None:
            self._offer_stores(plan, offers)
            for transfer in plan.kv_loads:
                state = connector.states.get(transfer.request_id)
                if state is not None and state.load is not None:
                    rid, reads = transfer.request_id, state.load.keys
                    self._queue("load", lambda rid=rid, reads=reads: client.load(rid, reads))
        for rid in connector.take_finished():
            self._queue("request_finished", lambda rid=rid: client.request_finished(rid))
        self.start_probes()
        self._export_counts(connector)

    def start_probes(self) -> None:
        """Probe the keys no probe has asked about yet (one batch). Also called as requests
        arrive (intake), so a request's answer is usually in before it reaches the head of
        the queue, instead of deferring it there for a step."""
        if self.lookup is None or self.client is None:
            return
        for task in self.lookup.flush():
            task.add_done_callback(lambda _: self.wake())

    def _offer_stores(self, plan: StepPlan, offers: list[StoreOffer]) -> None:
        """Queue each offer's `store` call; keep the plan's store transfers only while the
        kvstore is usable and not lagging (else they are dropped: nothing is written that the
        kvstore could not account for)."""
        admit = self.usable() and self._calls.qsize() < MAX_QUEUED_CALLS
        by_id = {t.transfer_id: t for t in plan.kv_stores}
        kept = []
        for offer in offers:
            transfer = by_id.get(offer.transfer_id or "")
            if not admit:
                if transfer is not None:
                    DROPPED_STORES.inc(len(offer.write))
                self.admission.mark_missing(k for k, _ in offer.write)
                continue
            written = [(key, end, self.chunk_bytes) for key, end in offer.write]
            store = None
            if transfer is not None:
                store = self._stores[transfer.transfer_id] = _Store(offer.request_id, written)
                kept.append(transfer)
            self._queue_store(offer, written, store)
        plan.kv_stores = kept
        if kept:
            self._stores_in_step[plan.step_id] = [t.transfer_id for t in kept]
        if len(self._stores) > MAX_PENDING_STORES:  # answers that never came (the kvstore
            for tid in list(self._stores)[: len(self._stores) // 2]:  # expires those writes)
                del self._stores[tid]
            for step in list(self._stores_in_step)[: len(self._stores_in_step) // 2]:
                del self._stores_in_step[step]

    def _queue_store(
        self, offer: StoreOffer, written: list[tuple[OffloadKey, int, int]], store: _Store | None
    ) -> None:
        client = self.client
        assert client is not None
        recorded = [(key, end, self.chunk_bytes) for key, end in offer.record]
        rid = offer.request_id

        async def run() -> None:
            reply = await self._call("store", lambda: client.store(rid, [*written, *recorded]))
            if store is not None:
                store.reply = reply
            if reply is None:
                return
            # Recorded chunks the kvstore does not have (evicted since): it reserved them for a
            # write nobody makes. Fail them now, and write them at their next offer.
            lost = {key for key, _ in offer.record} & set(reply.write)
            if lost:
                self.admission.mark_missing(lost)
                missing = [c for c in recorded if c[0] in lost]
                await self._call("stored", lambda: client.stored(missing, False))

        self._calls.put_nowait(("store", run))

    def _export_counts(self, connector: OffloadConnector) -> None:
        """Move the pure parts' counts into their Prometheus counters."""
        counts = {
            "query_tokens": connector.stats.external_query_tokens,
            "load": self.cost.stats.loads,
            "compute": self.cost.stats.computes,
            "no_lookup": connector.stats.lookups_skipped,
            "write": self.admission.stats.write,
            "record": self.admission.stats.record,
            "skip": self.admission.stats.skip,
        }
        for name, total in counts.items():
            new = total - self._counted.get(name, 0)
            if new <= 0:
                continue
            self._counted[name] = total
            if name == "query_tokens":
                QUERY_TOKENS.inc(new)
            elif name in ("load", "compute", "no_lookup"):
                LOADS.labels(decision=name).inc(new)
            else:
                STORE_OFFERS.labels(decision=name).inc(new)

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
            for key, _, _ in self._stores[tid].chunks
        ]
        if client is not None and keys:
            self._queue("writing", lambda: client.writing(keys))

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
                self.cost.observe_load(msg.num_bytes, msg.seconds)
            rid, keys = outcome.request_id, outcome.keys
            self._queue("loaded", lambda: client.loaded(rid, keys))
        else:
            store = self._stores.pop(msg.transfer_id, None)
            if store is None:
                return
            TRANSFERS.labels(kind="store", result=result).inc()
            self._on_store_done(store, msg)
        self.wake()

    def _on_store_done(self, store: _Store, msg: KVTransferDone) -> None:
        """Report the written chunks `stored` (all of them: see the module docstring) and the
        failed ones the kvstore was writing; count what the worker dropped."""
        space = self.connector.space  # type: ignore[union-attr]
        # A failed store names its failed chunks (dropped for staging, or not written); the
        # others were written (a store larger than staging writes its head) and are kept.
        named = msg.ok or bool(msg.failed_keys)
        failed = {space.parse(name) for name in msg.failed_keys} if named else None
        ok = [c for c in store.chunks if failed is not None and c[0] not in failed]
        bad = [c for c in store.chunks if failed is None or c[0] in failed]
        if msg.error and msg.error.startswith("dropped"):
            DROPPED_STORES.inc(len(bad))
        if ok:
            STORED_BYTES.inc(msg.num_bytes)
            if msg.num_bytes:  # the worker's bytes per chunk: offers carry it from now on
                self.chunk_bytes = msg.num_bytes // len(ok)
                ok = [(key, end, self.chunk_bytes) for key, end, _ in ok]
            self._queue_stored(store.request_id, ok, True, store)
            assert self.lookup is not None
            self.lookup.invalidate([c[0] for c in ok])  # present now: ask again
        if bad:
            self.admission.mark_missing(c[0] for c in bad)
            self._queue_stored(store.request_id, bad, False, store)
