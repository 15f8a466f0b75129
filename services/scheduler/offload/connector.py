"""The offload connector: the scheduler's decisions about the KV offload tier (pure core).

A waiting request at the head of the queue goes through `admit`:
- its keys beyond the local prefix hit are looked up in the `AsyncLookup` (attached when the
  request arrived, so one probe batch covers every queued request). An unknown verdict in the
  leading run defers the request one step (bounded by `max_defers`, then it computes);
- the longest hit beyond the local one becomes a LOAD (`window_hit`: full-attention groups
  need every chunk up to it, sliding-window groups only their window's chunks ending at it, the
  entries before the window being the null block): blocks are allocated (not registered in
  the prefix cache: `load_allocation`), a `KVTransfer` goes into the next plan's `kv_loads`,
  and the request leaves the waiting queue, computing nothing, until the worker's
  KVTransferDone;
- otherwise it is admitted for compute with its local hit.
A load that completed marks its blocks computed (registered in the prefix cache) and puts the
request back at the queue's front, holding its blocks: its next admission counts them as its
hit (`resumed_tokens`). A failed or refused load frees the blocks, forces its keys to misses and
requeues the request, which then recomputes what the tier could not give.

A hit is loaded only when the load is expected to beat recomputing it (`load_cost`: the tier's
bandwidth and the prefill rate, learned from the worker's own timings); a request whose whole
possible hit could not win is not even looked up (no probe, no defer). A request whose next
block is being loaded by another request is held (`HOLD`: set aside for this step, keeping its
place) until that load is answered, and then takes those blocks as a local prefix hit: a burst
of requests sharing a prefix reads it from the tier once (bounded by `max_holds`).

Stores: every plan considers, per scheduled request, the full blocks its computed tokens reach
after the step (prompt and sampled tokens only: `num_computed_tokens` never counts a
speculative draft here), each block once per request, keyed by block hash per prefix-cacheable
group. The store admission policy (`store_admission`) says which are written (a transfer in
`kv_stores`), which are only reported to the kvstore for recency (in the tier already), and
which are skipped (not likely to be read again). The edge reports each plan's offers to the
kvstore without holding the plan back. A sliding-window group offers only the chunks a hit at
the end of the offer would need (its window coverage, widened by the tokens retained for
speculation: the store mask of services.scheduler.offload.window_scan); null blocks (dropped out
of the window) are never offered.

State groups (hybrid models) are transferable but not storable: with `transfer_state` (a P/D
role) a state group takes part as a sliding window of one chunk (the entry rule: a hit of h
tokens needs only the state block ending at h), so an offer stores the state block at its end,
a lookup needs the state chunk at the hit end (the hit shortens to the largest boundary with a
stored state) and a load reads that one chunk, the entries before it being the null block.
Without it (role "both") state groups are left out and a hybrid never loads.

Ring-buffer groups (shared/kv/groups.py) are transferable but never stored or hashed by the
prefix cache either: role "both" leaves them out (and a model with one never loads), while a
P/D role ships them as a sliding window of `ring_size` positions. A ring table holds only its
n ring blocks, so chunk i lives in entry i % n, and only while no later position has reused
it: an offer skips the chunks the computed tokens already overwrote (i < ceil(c / bs) - n),
and a load writes chunk i into entry i % n of the freshly allocated ring (a ring never has a
local hit, so a load always starts at chunk 0 and allocates the ring from entry 0).

Blocks under a load the worker has not answered are never freed: a request finishing (abort)
meanwhile is kept as an orphan until the answer. A worker reset voids every load (the worker
drops its pending copies and reports them failed), so the blocks are freed at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.kv_cache_coordinator import KVCacheBlocks
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.kv.kv_cache_spec import (
    FullAttentionSpec,
    RingSpec,
    SlidingWindowSpec,
    StateSpec,
)
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.load_allocation import allocate_for_load
from services.scheduler.offload.load_cost import LoadCostModel
from services.scheduler.offload.request_state import LoadJob, OffloadRequestState
from services.scheduler.offload.store_admission import StoreAdmission, StoreDecision
from services.scheduler.offload.verdict import Verdict
from services.scheduler.offload.window_hit import GroupWindow, window_hit
from services.scheduler.request import Request
from services.scheduler.spec.lookahead import retained_tokens
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.protocol.kv_transfer import KVTransfer

Chunk = tuple[OffloadKey, int]  # (key, end position)


@dataclass(frozen=True, slots=True)
class Admission:
    action: Literal["compute", "defer", "load", "hold"]
    hit_blocks: KVCacheBlocks | None = None  # for "compute"; None for a resumed request
    num_hit_tokens: int = 0


DEFER = Admission("defer")
LOADING = Admission("load")
HOLD = Admission("hold")


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What a finished (or refused) load did."""

    request_id: str
    ok: bool
    loaded_tokens: int  # tokens now computed from the tier (0 when failed)
    keys: list[OffloadKey]  # the load's keys: their pins are released
    requeued: Request | None  # back to the front of the waiting queue (None: request gone)


@dataclass
class OffloadStats:
    external_query_tokens: int = 0  # tokens beyond the local hit looked up at admission
    external_hit_tokens: int = 0  # of those, loaded from the tier
    loads_started: int = 0
    loads_failed: int = 0
    defers: int = 0  # steps a request waited for an unanswered probe
    pending_defers: int = 0  # steps a request waited for a chunk's write in flight
    holds: int = 0  # steps a request waited for another request's load of its next block
    lookups_skipped: int = 0  # requests not looked up: even a full hit would not beat recompute


@dataclass
class StoreOffer:
    """One request's chunks reported to the kvstore in one plan: `write` (aligned with the
    keys of the store transfer `transfer_id`, None when nothing is written) and `record` (in the
    tier already: reported for the request's recency only)."""

    request_id: str
    transfer_id: str | None = None
    write: list[Chunk] = field(default_factory=list)
    record: list[Chunk] = field(default_factory=list)

    @property
    def chunks(self) -> list[Chunk]:
        return [*self.write, *self.record]


class OffloadConnector:
    def __init__(
        self,
        config: SchedulerConfig,
        space: KeySpace,
        lookup: AsyncLookup,
        transfer_prefix: str,
        *,
        max_defers: int = 50,
        max_holds: int = 200,
        max_loading: int | None = None,
        store: bool = True,
        store_admission: StoreAdmission | None = None,
        cost: LoadCostModel | None = None,
        chunk_bytes: int = 0,
        transfer_state: bool = False,
    ) -> None:
        self.block_size = config.block_size
        # Only prefix-cacheable groups are hashed, stored and looked up ("transferable is not
        # storable"); a request whose groups are not all cacheable never loads. Under P/D
        # (`transfer_state`: a prefill or decode role) every transferable group takes part: the
        # state groups of a hybrid model (the prefill side stores the state block at the end of
        # each offer, the decode side loads the one ending at its hit: a sliding window of one
        # chunk) and ring groups (a sliding window of their ring).
        self.groups = transfer_projection(config, transfer_state)
        # Ring groups taking part: group -> its ring blocks (chunk i lives in entry i % n).
        self.ring_blocks = {
            g: spec.n_ring_blocks
            for g in self.groups
            if isinstance(spec := config.kv_cache_groups[g].spec, RingSpec)
        }
        self.state_groups = [
            g for g in self.groups if isinstance(config.kv_cache_groups[g].spec, StateSpec)
        ]
        self.all_groups_cacheable = len(self.groups) == len(config.kv_cache_groups)
        # Full attention loads every chunk of the hit, a sliding window only the chunks of its
        # coverage (window + tokens retained for speculation, CONTRACTS.md) ending at the hit,
        # a state group only the chunk ending at the hit.
        self.windows = [_group_window(g, config) for g in self.groups]
        self.loads_supported = self.all_groups_cacheable and all(
            isinstance(group.spec, FullAttentionSpec | SlidingWindowSpec | StateSpec | RingSpec)
            for group in config.kv_cache_groups
        )
        self.space = space
        self.lookup = lookup
        self.max_defers = max_defers
        self.max_holds = max_holds
        self.max_loading = max_loading or config.max_num_seqs
        # False for a decode-role scheduler (services/scheduler/pd): a KV consumer, it loads
        # what prefill groups stored and offers nothing (vLLM's kv_consumer).
        self.store = store
        self.admission = store_admission or StoreAdmission()
        self.cost = cost or LoadCostModel()
        self.chunk_bytes = chunk_bytes  # payload bytes of one chunk (0: unknown, bytes not costed)
        self._ids = (f"{transfer_prefix}:{n}" for n in itertools.count())
        self.states: dict[str, OffloadRequestState] = {}
        self.requests: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}  # transfer id -> request being loaded
        # Block hashes an in-flight load is filling -> its transfer id: a request whose next
        # block is among them waits for that load instead of reading (or computing) it again.
        self.producing: dict[OffloadKey, str] = {}
        self.orphans: dict[str, tuple[Request, LoadJob]] = {}  # finished under a load
        self.pending_loads: list[KVTransfer] = []  # for the next plan
        self.store_offers: list[StoreOffer] = []  # the plans' offers, for the kvstore (edge pops)
        # Offers gathered for the plan being built: request id -> (offer, groups, block ids).
        self._open_offers: dict[str, tuple[StoreOffer, list[int], list[int]]] = {}
        self.finished_ids: list[str] = []  # for the kvstore's request_finished (the edge pops)
        self.stats = OffloadStats()

    # ------------------------------------------------------------------------ requests

    def on_request_added(self, request: Request) -> None:
        """Attach the request's keys to the async lookup now, so the next probe batch covers
        every queued request, not only the head of the queue."""
        state = self.states.setdefault(request.request_id, OffloadRequestState(request.request_id))
        self.requests[request.request_id] = request
        cap = self._max_hit_blocks(request)
        if not self._worth_looking_up(state.keys_looked_up, cap):
            if state.keys_looked_up == 0 and cap > 0:
                self.stats.lookups_skipped += 1
            return
        for i in range(state.keys_looked_up, cap):
            for g in self.groups:
                self.lookup.lookup(request.request_id, OffloadKey(request.block_hashes[i], g))
        state.keys_looked_up = max(state.keys_looked_up, cap)

    def is_loading(self, request_id: str) -> bool:
        state = self.states.get(request_id)
        return state is not None and state.load is not None

    def request_finished(self, request: Request, kv: KVCacheManager) -> None:
        """The request finished (stop, length, abort, error): free its blocks now, or when its
        load is answered; its kvstore record is committed by the edge."""
        rid = request.request_id
        state = self.states.pop(rid, None)
        self.requests.pop(rid, None)
        self.lookup.request_finished(rid)
        self.finished_ids.append(rid)
        if state is not None and state.load is not None:
            tid = state.load.transfer.transfer_id
            self.loading.pop(tid, None)
            self._stop_producing(tid)
            if any(t.transfer_id == tid for t in self.pending_loads):
                self.pending_loads = [t for t in self.pending_loads if t.transfer_id != tid]
                kv.free(request)  # never sent: nobody writes into its blocks
            else:
                self.orphans[tid] = (request, state.load)
            return
        kv.free(request)

    # ----------------------------------------------------------------------- admission

    def admit(self, request: Request, kv: KVCacheManager) -> Admission:
        """Decide for the waiting head: compute (with which hit), defer, or load (the request
        then left the queue: the caller pops it)."""
        state = self.states.get(request.request_id)
        if state is None:
            self.on_request_added(request)
            state = self.states[request.request_id]
        if state.resumed_tokens:
            return Admission("compute", None, state.resumed_tokens)
        hit_blocks, num_hit = kv.get_computed_blocks(request)
        if not self.groups or not self.loads_supported or not kv.enable_caching:
            return Admission("compute", hit_blocks, num_hit)
        if request.computes_every_position:  # routed experts, prompt logprobs
            return Admission("compute", hit_blocks, num_hit)
        first = num_hit // self.block_size
        cap = self._max_hit_blocks(request)
        if first < cap and self._held(request, state, self._load_keys(request, first, first + 1)):
            return HOLD
        if not self._worth_looking_up(first, cap):
            return Admission("compute", hit_blocks, num_hit)  # even a full hit would not pay
        end, unanswered = self._hit_end(request, hit_blocks, first, cap, settle=False)
        if end is None and not unanswered:
            # Only writes in flight stand in the way: ask again next step. Bounded by the
            # lookup, which answers MISS for a chunk pending longer than its `max_pending_s`.
            self.stats.pending_defers += 1
            return DEFER
        if end is None:
            if state.defers < self.max_defers:
                state.defers += 1
                self.stats.defers += 1
                return DEFER
            end, _ = self._hit_end(request, hit_blocks, first, cap, settle=True)
        assert end is not None
        self.stats.external_query_tokens += (cap - first) * self.block_size
        run = end - first
        if run <= 0 or len(self.loading) >= self.max_loading:
            return Admission("compute", hit_blocks, num_hit)
        if self._held(request, state, self._load_keys(request, first, end)):
            return HOLD  # another request's load is reading these chunks: never read twice
        if not self.cost.decide(run * self.block_size, self._load_bytes(run)):
            return Admission("compute", hit_blocks, num_hit)  # recomputing it is faster
        held = self._held_for_load(kv, hit_blocks, first, end)
        num_load = run * self.block_size
        new_blocks = allocate_for_load(kv, request, held, num_hit, num_load)
        if new_blocks is None:
            return DEFER  # no room for the load: no room to compute it either (FCFS head)
        self._start_load(request, state, first, end, num_hit, new_blocks, kv)
        return LOADING

    def _held(
        self, request: Request, state: OffloadRequestState, keys: Iterable[OffloadKey]
    ) -> bool:
        """Whether the request waits for another request's in-flight load of any of `keys` (the
        chunks it would read). Bounded: after `max_holds` steps it goes its own way."""
        if state.holds >= self.max_holds:
            return False
        for key in keys:
            tid = self.producing.get(key)
            producer = self.loading.get(tid) if tid is not None else None
            if producer is not None and producer is not request:
                state.holds += 1
                self.stats.holds += 1
                return True
        return False

    def _load_keys(self, request: Request, first: int, end: int) -> list[OffloadKey]:
        """The chunks a load of the hit [first, end) reads: every chunk of a full group, only
        the window coverage ending at `end` of a sliding group (the lookup's coverage)."""
        hashes = request.block_hashes
        return [
            OffloadKey(hashes[i], window.group)
            for window in self.windows
            for i in window.chunks(first, end)
        ]

    def _load_bytes(self, num_chunks: int) -> int:
        # A state group moves one chunk per hit, whatever its length (costed as one chunk).
        attention = len(self.groups) - len(self.state_groups)
        return (num_chunks * attention + len(self.state_groups)) * self.chunk_bytes

    def _worth_looking_up(self, first: int, cap: int) -> bool:
        """Whether a hit of every block in [first, cap) could beat recomputing them: if not,
        the request is not looked up at all (no probe, and no step deferred for its answer)."""
        run = cap - first
        return run > 0 and self.cost.load_wins(run * self.block_size, self._load_bytes(run))

    def _max_hit_blocks(self, request: Request) -> int:
        # A hit is capped at num_tokens - 1: the last token is recomputed for its logits.
        return min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))

    def _hit_end(
        self, request: Request, hit_blocks: KVCacheBlocks, first: int, cap: int, *, settle: bool
    ) -> tuple[int | None, bool]:
        """The hit's end in chunks (see `window_hit`), or None to ask again next step; and
        whether an unanswered probe was seen (else only writes in flight made it wait). With
        `settle` (the request deferred often enough) an unknown or pending key is a miss."""
        rid = request.request_id
        hashes = request.block_hashes
        unanswered = False

        def verdict_of(i: int, g: int) -> Verdict:
            nonlocal unanswered
            verdict = self.lookup.lookup(rid, OffloadKey(hashes[i], g))
            if settle and verdict in (Verdict.RETRY, Verdict.HIT_PENDING):
                return Verdict.MISS
            unanswered |= verdict is Verdict.RETRY
            return verdict

        def local_has(i: int, g: int) -> bool:
            return not hit_blocks[g][i].is_null

        return window_hit(self.windows, verdict_of, first, cap, local_has), unanswered

    def _held_for_load(
        self, kv: KVCacheManager, hit_blocks: KVCacheBlocks, first: int, end: int
    ) -> KVCacheBlocks:
        """The blocks the request holds before the loaded ones, per group: its local hit, and
        in a sliding group the null block wherever the hit's window does not reach (so the
        allocation takes exactly the blocks the load fills)."""
        held = [list(blocks) for blocks in hit_blocks]
        for window in self.windows:
            if window.coverage is None or window.group in self.ring_blocks:
                continue  # full attention holds its whole local hit; a ring holds no nulls
            null = kv.coordinator.pool_of_group(window.group).null_block
            start = window.chunks(first, end).start
            blocks = held[window.group]
            blocks[:start] = [null] * min(start, len(blocks))
            blocks.extend([null] * (start - len(blocks)))
        return held

    def _start_load(
        self,
        request: Request,
        state: OffloadRequestState,
        first: int,
        end: int,
        num_hit: int,
        new_blocks: KVCacheBlocks,
        kv: KVCacheManager,
    ) -> None:
        chunks: list[Chunk] = []
        names: list[str] = []
        groups: list[int] = []
        block_ids: list[int] = []
        loaded = [window.chunks(first, end) for window in self.windows]
        run = end - first
        for i in range(first, end):
            for window, chunk_range in zip(self.windows, loaded, strict=True):
                if i not in chunk_range:
                    continue  # before a sliding window: its table entry is the null block
                g = window.group
                key = OffloadKey(request.block_hashes[i], g)
                chunks.append((key, (i + 1) * self.block_size))
                names.append(self.space.payload_key(key))
                groups.append(g)
                ring = self.ring_blocks.get(g)
                entry = i - chunk_range.start if ring is None else i % ring
                block_ids.append(new_blocks[g][entry].block_id)
        tid = next(self._ids)
        transfer = KVTransfer(
            transfer_id=tid,
            request_id=request.request_id,
            keys=names,
            groups=groups,
            block_ids=block_ids,
        )
        num_tokens = num_hit + run * self.block_size
        state.load = LoadJob(transfer, chunks, first, run, num_tokens, num_hit)
        self.loading[tid] = request
        for key, _ in chunks:
            self.producing.setdefault(key, tid)
        self.pending_loads.append(transfer)
        self.stats.loads_started += 1
        # The local hit in front of the loaded run is offered for store too: its keys join the
        # request's record, so the head of the prefix is refreshed with its tail (and written
        # if the tier lost it). Its blocks hold their KV already and stay held by the request.
        if first and self.store:
            self._offer(request, kv, 0, first)
        state.offered_blocks = first + run

    # ------------------------------------------------------------------------ the plan

    def has_pending_loads(self) -> bool:
        return bool(self.pending_loads)

    def plan_transfers(
        self, num_scheduled: Mapping[str, int], kv: KVCacheManager
    ) -> tuple[list[KVTransfer], list[KVTransfer]]:
        """The plan's loads (started since the last plan) and store offers: for every scheduled
        request, the full blocks its computed tokens reach after this step, not offered yet."""
        loads, self.pending_loads = self.pending_loads, []
        for rid in num_scheduled if self.store else ():
            state = self.states.get(rid)
            request = self.requests.get(rid)
            if state is None or request is None:
                continue
            state.resumed_tokens = 0  # admitted with them
            num_full = min(
                request.num_computed_tokens // self.block_size, len(request.block_hashes)
            )
            if num_full > state.offered_blocks:
                self._offer(request, kv, state.offered_blocks, num_full)
                state.offered_blocks = num_full
        stores = self._take_offer_transfers()
        return loads, stores

    def _offer(self, request: Request, kv: KVCacheManager, begin: int, end: int) -> None:
        rid = request.request_id
        offer = self._open_offers.get(rid)
        if offer is None:
            offer = self._open_offers[rid] = (StoreOffer(rid), [], [])
        store, groups, block_ids = offer
        tables = kv.coordinator.get_blocks(rid)
        state = self.states[rid]
        # The store mask: a chunk is worth storing only where a hit at `end` needs it.
        masks = [window.worth_storing(end) for window in self.windows]
        # A ring still holds chunk i only if no computed position reused its entry.
        ring_start = -(-request.num_computed_tokens // self.block_size)
        for i in range(begin, end):
            for window, mask in zip(self.windows, masks, strict=True):
                g = window.group
                ring = self.ring_blocks.get(g)
                if ring is None:
                    block = tables[g][i]
                elif i >= ring_start - ring:
                    block = tables[g][i % ring]
                else:
                    continue  # overwritten in the ring by a later position
                if block.is_null or not mask[i]:
                    continue  # out of a sliding window: nothing a hit would read
                key = OffloadKey(request.block_hashes[i], g)
                chunk = (key, (i + 1) * self.block_size)
                decision = self.admission.decide(key, rid)
                if decision is StoreDecision.SKIP:
                    continue  # not likely to be read again: the tier never hears of it
                state.offered.append(chunk)
                if decision is StoreDecision.RECORD:
                    store.record.append(chunk)
                    continue
                store.write.append(chunk)
                groups.append(g)
                block_ids.append(block.block_id)

    def _take_offer_transfers(self) -> list[KVTransfer]:
        transfers = []
        for rid, (offer, groups, block_ids) in self._open_offers.items():
            if offer.write:
                offer.transfer_id = tid = next(self._ids)
                transfers.append(
                    KVTransfer(
                        transfer_id=tid,
                        request_id=rid,
                        keys=[self.space.payload_key(k) for k, _ in offer.write],
                        groups=groups,
                        block_ids=block_ids,
                    )
                )
            if offer.write or offer.record:
                self.store_offers.append(offer)
        self._open_offers.clear()
        return transfers

    def take_store_offers(self) -> list[StoreOffer]:
        """The offers of the plans built since the last call, in plan order (the edge reports
        them to the kvstore)."""
        offers, self.store_offers = self.store_offers, []
        return offers

    # ------------------------------------------------------------------- load answers

    def load_done(
        self, transfer_id: str, ok: bool, failed_keys: Iterable[str], kv: KVCacheManager
    ) -> LoadOutcome | None:
        """The worker answered a load (or the edge could not pin it: `ok=False`, never sent).
        None for a transfer this connector does not know (stale: a reset voided it)."""
        self._stop_producing(transfer_id)
        orphan = self.orphans.pop(transfer_id, None)
        if orphan is not None:
            request, job = orphan
            kv.free(request)  # the worker is done with its blocks
            return LoadOutcome(request.request_id, ok, 0, [k for k, _ in job.keys], None)
        request = self.loading.pop(transfer_id, None)
        if request is None:
            return None
        state = self.states[request.request_id]
        job = state.load
        assert job is not None and job.transfer.transfer_id == transfer_id
        state.load = None
        self.pending_loads = [t for t in self.pending_loads if t.transfer_id != transfer_id]
        keys = [k for k, _ in job.keys]
        if ok:
            kv.cache_blocks(request, job.num_tokens)  # computed now: findable by others too
            state.resumed_tokens = job.num_tokens
            state.loaded.extend(job.keys)
            self.admission.mark_stored(keys)
            self.stats.external_hit_tokens += job.loaded_tokens
            return LoadOutcome(request.request_id, True, job.loaded_tokens, keys, request)
        failed = {self.space.parse(name) for name in failed_keys} or set(keys)
        self.lookup.mark_load_failed(failed)
        self.admission.mark_missing(failed)
        kv.free(request)
        request.num_computed_tokens = 0
        state.offered_blocks = job.first_block  # the loaded run is computed (and offered) later
        self.stats.loads_failed += 1
        return LoadOutcome(request.request_id, False, 0, keys, request)

    def worker_reset(self, kv: KVCacheManager) -> list[Request]:
        """The worker lost its KV (restart or failed step): every load is void. Frees the blocks
        of loading, resumed and orphaned requests; returns the loading requests, in order, for
        the caller to requeue (resumed ones are in the waiting queue already)."""
        requeue = []
        for request in self.loading.values():
            state = self.states[request.request_id]
            assert state.load is not None
            state.offered_blocks = state.load.first_block
            state.load = None
            kv.free(request)
            request.num_computed_tokens = 0
            requeue.append(request)
        for request, _ in self.orphans.values():
            kv.free(request)
        for rid, state in self.states.items():
            if state.resumed_tokens:
                state.resumed_tokens = 0
                kv.free(self.requests[rid])
        self.loading.clear()
        self.producing.clear()
        self.orphans.clear()
        self.pending_loads = []
        return requeue

    def _stop_producing(self, transfer_id: str) -> None:
        for key in [k for k, tid in self.producing.items() if tid == transfer_id]:
            del self.producing[key]

    def take_finished(self) -> list[str]:
        ids, self.finished_ids = self.finished_ids, []
        return ids

    def recorded(self, request_id: str) -> list[Chunk]:
        """Keys the request reported to the tier (loaded or offered), with end positions."""
        state = self.states.get(request_id)
        return state.recorded() if state is not None else []


def transfer_projection(config: SchedulerConfig, transfer_state: bool) -> list[int]:
    """The groups whose blocks the tier moves: the prefix-cacheable ones for the prefix cache
    (role "both": never a state or ring group, which no block hash describes), every
    transferable group for a P/D handoff (`transfer_state`), which ships a request's whole KV
    at one point in its sequence. A transfer's block ids are projected onto these groups."""
    return [
        g
        for g, group in enumerate(config.kv_cache_groups)
        if group.spec.prefix_cacheable or (transfer_state and group.spec.transferable)
    ]


def _group_window(group: int, config: SchedulerConfig) -> GroupWindow:
    """How group `group` needs the chunks of a hit. A sliding group's coverage counts the
    tokens it retains for speculation (`retained_tokens` of the one lookahead number,
    CONTRACTS.md), as does its store mask (the widened spec's coverage is the same number)."""
    spec = config.kv_cache_groups[group].spec
    if isinstance(spec, StateSpec):
        # The entry rule (shared/kv/groups.py): a hit of h tokens needs only the state block
        # ending at h, i.e. a window of one chunk; speculation retains nothing in the tier.
        return GroupWindow.sliding(group, 1, config.block_size)
    if isinstance(spec, RingSpec):
        # A hit of h tokens needs the ring's last positions before h, as a window of
        # `ring_size` does; speculation is refused with a ring group (SchedulerConfig).
        return GroupWindow.sliding(group, spec.ring_size, config.block_size)
    if not isinstance(spec, SlidingWindowSpec):
        return GroupWindow(group)
    retained = retained_tokens(config.lookahead_tokens)
    return GroupWindow.sliding(group, spec.sliding_window, config.block_size, retained)
