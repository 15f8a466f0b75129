"""One side of a P/D pair for a model with several KV cache groups (hybrid state, ring): the
real Scheduler and OffloadConnector over a GroupWorker, with a dict standing for the Redis tier
that keeps each chunk's body (K/V slot tokens, or the token tuple a state stands for), so a
chunk written into the wrong block, or a state read at the wrong point, fails the run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.scheduler.config import SchedulerConfig
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector
from services.scheduler.offload.store_admission import StoreAdmission
from services.scheduler.pd import PrefillPolicy, prefilled_in_step
from services.scheduler.scheduler import Scheduler
from shared.kv.groups import LayerCache
from shared.protocol import StepPlan, SubmitRequest
from tests.unit.scheduler.driver import ClientView
from tests.unit.scheduler.group_worker import GroupWorker
from tests.unit.scheduler.offload.harness import SPACE, Tier


@dataclass
class StateTier(Tier):
    """The tier with each chunk's body: ("kv", slot tokens) or ("state", the token tuple the
    state stands for); `payloads` only marks presence for the probe."""

    bodies: dict[str, tuple[str, object]] = field(default_factory=dict)

    def put(self, key: str, kind: str, body: object) -> None:
        self.payloads[key] = []
        self.bodies[key] = (kind, body)

    def drop(self, key: str) -> None:
        del self.payloads[key], self.bodies[key]


@dataclass
class Side:
    scheduler: Scheduler
    worker: GroupWorker
    lookup: AsyncLookup
    tier: StateTier
    state_group: int  # the group whose chunks are states (the others hold K/V slots)
    client: ClientView = field(default_factory=ClientView)
    plans: list[StepPlan] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        tier: StateTier,
        cfg: SchedulerConfig,
        layers: list[LayerCache],
        *,
        state_group: int,
        role: str,
    ) -> Side:
        """`layers`: the GroupWorker's per-layer cache kinds, matching `cfg`'s groups."""
        scheduler = Scheduler(cfg, role)
        lookup = AsyncLookup(tier.verdicts, max_pending_s=2.0)
        scheduler.offload = OffloadConnector(
            cfg,
            SPACE,
            lookup,
            role,
            store=role != "decode",
            store_admission=StoreAdmission("always"),
            transfer_state=role != "both",
        )
        scheduler.prefill_only = role == "prefill"
        worker = GroupWorker(cfg.block_size, layers)
        return cls(scheduler, worker, lookup, tier, state_group)

    @property
    def connector(self) -> OffloadConnector:
        assert self.scheduler.offload is not None
        return self.scheduler.offload

    def store(self, plan: StepPlan) -> None:
        """The worker's stores after the step: each chunk's block contents into the tier."""
        for t in plan.kv_stores:
            for key, group, block in zip(t.keys, t.groups, t.block_ids, strict=True):
                if group == self.state_group:
                    self.tier.put(key, "state", self.worker.states[(group, block)])
                else:
                    slots = self.worker.kv[(group, block)]
                    assert None not in slots
                    self.tier.put(key, "kv", list(slots))

    def load(self, plan: StepPlan) -> None:
        for t in plan.kv_loads:
            failed = [k for k in t.keys if k not in self.tier.payloads]
            if not failed:
                for key, group, block in zip(t.keys, t.groups, t.block_ids, strict=True):
                    kind, body = self.tier.bodies[key]
                    if group == self.state_group:
                        assert kind == "state" and isinstance(body, tuple)
                        self.worker.states[(group, block)] = body
                    else:
                        assert kind == "kv" and isinstance(body, list)
                        self.worker.kv[(group, block)] = list(body)
            self.scheduler.kv_load_done(t.transfer_id, not failed, failed)

    async def step(self) -> StepPlan | None:
        await asyncio.gather(*self.lookup.flush())
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        self.plans.append(plan)
        out = self.scheduler.update_from_output(plan, self.worker.run(plan))
        for stream, deltas in out.deltas.items():
            for delta in deltas:
                self.client.apply(stream, delta)
        self.store(plan)
        self.load(plan)
        return plan

    async def run(self) -> None:
        for _ in range(500):
            plan = await self.step()
            if plan is None and not self.scheduler.has_work():
                return
        raise AssertionError("not done")

    async def prefill(self, msg: SubmitRequest, lookahead: int) -> Side:
        """Run a prefill role's job for `msg` until its prompt (less the lookahead) is in."""
        job = PrefillPolicy(lookahead, self.scheduler.config.block_size).job_for(msg)
        assert job is not None
        self.scheduler.add_request(job)
        for _ in range(100):
            plan = await self.step()
            assert plan is not None
            if prefilled_in_step(plan, {msg.request_id: len(job.prompt_token_ids)}):
                return self
        raise AssertionError("never prefilled")
