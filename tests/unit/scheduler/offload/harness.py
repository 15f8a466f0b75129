"""A scheduler with an offload connector, driven step by step against the WorkerDouble.

The tier is a dict of payloads (what Redis holds) and the probe backend answers from it; the
transfer side of the worker is played by `TransferDouble`: stores copy the double's block
contents (the token written in each slot) into the tier after the step, loads copy tier
payloads into the listed blocks. So a load that put the wrong chunk in a block is caught by the
WorkerDouble's check that every prefix-hit block holds the request's tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector
from services.scheduler.offload.store_admission import StoreAdmission, StorePolicyName
from services.scheduler.offload.verdict import Verdict
from services.scheduler.scheduler import Scheduler
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.protocol import KVTransferDone, StepPlan
from tests.unit.scheduler.driver import ClientView
from tests.unit.scheduler.worker_double import WorkerDouble

BLOCK = 4
SPACE = KeySpace("c", "m", 1)


@dataclass
class Tier:
    payloads: dict[str, list[int | None]] = field(default_factory=dict)
    writing: set[str] = field(default_factory=set)  # payload keys whose write is in flight
    probes: int = 0

    async def verdicts(self, keys: list[OffloadKey]) -> dict[OffloadKey, Verdict]:
        """What the kvstore answers: ready chunks HIT, chunks being written HIT_PENDING."""
        self.probes += 1
        found = {}
        for k in keys:
            name = SPACE.payload_key(k)
            if name in self.writing:
                found[k] = Verdict.HIT_PENDING
            elif name in self.payloads:
                found[k] = Verdict.HIT
        return found


@dataclass
class TransferDouble:
    worker: WorkerDouble
    tier: Tier

    def after_step(self, plan: StepPlan) -> list[KVTransferDone]:
        done = []
        for t in plan.kv_stores:
            for key, block_id in zip(t.keys, t.block_ids, strict=True):
                slots = self.worker.kv.get(block_id)
                assert slots is not None and None not in slots, f"store of unwritten {block_id}"
                self.tier.payloads[key] = list(slots)
            done.append(_done(t.transfer_id, t.request_id, "store", True))
        return done

    def load(self, plan: StepPlan, fail: set[str] = frozenset()) -> list[KVTransferDone]:  # type: ignore[assignment]
        done = []
        for t in plan.kv_loads:
            failed = [k for k in t.keys if k in fail or k not in self.tier.payloads]
            if not failed:
                for key, block_id in zip(t.keys, t.block_ids, strict=True):
                    self.worker.kv[block_id] = list(self.tier.payloads[key])
            done.append(_done(t.transfer_id, t.request_id, "load", not failed, failed))
        return done


def _done(tid: str, rid: str, kind: str, ok: bool, failed=()) -> KVTransferDone:
    return KVTransferDone(
        worker_id="double",
        transfer_id=tid,
        request_id=rid,
        kind=kind,  # type: ignore[arg-type]
        ok=ok,
        failed_keys=list(failed),
    )


def config(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "block_size": BLOCK,
        "num_gpu_blocks": 64,
        "max_num_batched_tokens": 64,
        "max_model_len": 200,
    }
    return SchedulerConfig(**{**base, **kw})  # type: ignore[arg-type]


@dataclass
class OffloadRig:
    scheduler: Scheduler
    tier: Tier
    worker: WorkerDouble
    transfers: TransferDouble
    lookup: AsyncLookup
    client: ClientView = field(default_factory=ClientView)
    plans: list[StepPlan] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        tier: Tier | None = None,
        store_policy: StorePolicyName = "always",
        clock: Callable[[], float] = time.monotonic,
        **kw: object,
    ) -> OffloadRig:
        """The mechanics of loads and stores are tested with every block stored ("always");
        the store policy's own tests pass "reuse". A chunk pending longer than 2 s by `clock`
        is a miss."""
        tier = tier or Tier()
        cfg = config(**kw)
        scheduler = Scheduler(cfg, "s")
        lookup = AsyncLookup(tier.verdicts, max_pending_s=2.0, clock=clock)
        scheduler.offload = OffloadConnector(
            cfg, SPACE, lookup, "t", store_admission=StoreAdmission(store_policy)
        )
        worker = WorkerDouble(BLOCK)
        return cls(scheduler, tier, worker, TransferDouble(worker, tier), lookup)

    @property
    def connector(self) -> OffloadConnector:
        assert self.scheduler.offload is not None
        return self.scheduler.offload

    async def probe(self) -> None:
        """What the edge does every step: probe the keys looked up since the last flush."""
        await asyncio.gather(*self.lookup.flush())

    def step(self) -> StepPlan | None:
        """Schedule and run one plan: compute, then stores (loads are answered by the test)."""
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        self.plans.append(plan)
        out = self.scheduler.update_from_output(plan, self.worker.run(plan))
        for stream, deltas in out.deltas.items():
            for delta in deltas:
                self.client.apply(stream, delta)
        self.transfers.after_step(plan)
        return plan

    def answer_loads(self, plan: StepPlan, fail: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        for done in self.transfers.load(plan, fail):
            self.scheduler.kv_load_done(done.transfer_id, done.ok, done.failed_keys)

    async def run(self, max_steps: int = 1000) -> None:
        """Until every request finished, answering loads at once and probing every step."""
        for _ in range(max_steps):
            await self.probe()
            plan = self.step()
            if plan is not None:
                self.answer_loads(plan)
            elif not self.scheduler.has_work():
                return
        raise AssertionError("not done")


class CheckedAllocations:
    """Records (estimate, blocks taken) for every `allocate_slots` of `kv` that succeeds: the
    admission contract is that the two are equal."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.pairs: list[tuple[int, int]] = []
        real = kv.allocate_slots

        def checked(request, num_new, hit=None, num_hit=None):  # type: ignore[no-untyped-def]
            estimate = kv.estimate_blocks_to_allocate(request, num_new, hit, num_hit)
            before = kv.num_free_blocks
            result = real(request, num_new, hit, num_hit)
            if result is not None:
                self.pairs.append((estimate, before - kv.num_free_blocks))
            return result

        kv.allocate_slots = checked  # type: ignore[method-assign]
