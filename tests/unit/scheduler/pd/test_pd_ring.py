"""P/D for a model with full attention, a ring-buffer group and a recurrent-state group:
the handoff ships the ring ("transferable"), while role "both" never stores or looks one up.

The prefill side offers a ring chunk only while its ring entry still holds it (chunk i lives
in entry i % n until a later position reuses the entry); the decode side loads the ring chunks
a hit needs into entries i % n of its fresh ring and resumes. Both sides run a GroupWorker,
which checks every ring position a step reads against the tokens it stands for, so a chunk
written into the wrong entry, or stored after being overwritten, fails the run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector
from services.scheduler.offload.store_admission import StoreAdmission
from services.scheduler.pd import PrefillPolicy, prefilled_in_step
from services.scheduler.scheduler import Scheduler
from shared.kv.groups import STATE, Ring
from shared.protocol import StepPlan, SubmitRequest
from tests.unit.scheduler.driver import ClientView, submit
from tests.unit.scheduler.group_worker import GroupWorker
from tests.unit.scheduler.offload.harness import SPACE
from tests.unit.scheduler.pd.test_pd_hybrid import StateTier
from tests.unit.scheduler.test_ring_group import FULL, N_RING, RING, RING_G, STATE_G, groups
from tests.unit.scheduler.worker_double import token_at

BS = 4
PROMPT = list(range(300, 323))  # 23 tokens


def config(step_tokens: int) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=64,
        num_state_blocks=24,
        max_num_batched_tokens=step_tokens,
        max_model_len=200,
        kv_cache_groups=groups(),
    )


@dataclass
class Side:
    scheduler: Scheduler
    worker: GroupWorker
    lookup: AsyncLookup
    tier: StateTier
    client: ClientView = field(default_factory=ClientView)
    plans: list[StepPlan] = field(default_factory=list)

    @classmethod
    def build(cls, tier: StateTier, *, role: str, step_tokens: int = 8) -> Side:
        cfg = config(step_tokens)
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
        return cls(scheduler, GroupWorker(BS, [None, Ring(RING), STATE]), lookup, tier)

    @property
    def connector(self) -> OffloadConnector:
        assert self.scheduler.offload is not None
        return self.scheduler.offload

    def store(self, plan: StepPlan) -> None:
        """The worker's stores after the step: K/V slots (full and ring) or a state."""
        for t in plan.kv_stores:
            for key, group, block in zip(t.keys, t.groups, t.block_ids, strict=True):
                if group == STATE_G:
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
                    if group == STATE_G:
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


async def prefill(msg: SubmitRequest, tier: StateTier, lookahead: int, step_tokens: int) -> Side:
    side = Side.build(tier, role="prefill", step_tokens=step_tokens)
    job = PrefillPolicy(lookahead, BS).job_for(msg)
    assert job is not None
    side.scheduler.add_request(job)
    for _ in range(100):
        plan = await side.step()
        assert plan is not None
        if prefilled_in_step(plan, {msg.request_id: len(job.prompt_token_ids)}):
            return side
    raise AssertionError("never prefilled")


def ring_chunks_stored(side: Side) -> list[int]:
    """Chunk indexes of the ring chunks the side's plans stored."""
    out = []
    for plan in side.plans:
        for t in plan.kv_stores:
            ends = dict(side.connector.recorded(t.request_id))
            for key, group in zip(t.keys, t.groups, strict=True):
                if group == RING_G:
                    out.append(ends[SPACE.parse(key)] // BS - 1)
    return sorted(out)


@pytest.mark.parametrize(("lookahead", "step_tokens"), [(3, 8), (1, 8), (3, 16), (1, 6), (3, 14)])
async def test_prefill_ships_the_ring_and_decode_resumes_from_it(
    lookahead: int, step_tokens: int
) -> None:
    tier = StateTier()
    msg = submit("a", PROMPT, max_tokens=5)
    pre = await prefill(msg, tier, lookahead, step_tokens)
    handed = (len(PROMPT) - max(1, lookahead)) // BS  # 5 full blocks
    stored = ring_chunks_stored(pre)
    assert_ring_bodies_hold_their_chunks(pre, tier, PROMPT)
    # The chunks a hit at the handed-over end needs (the last RING - 1 positions before it).
    assert set(range(handed - N_RING, handed)) <= set(stored)
    assert all(
        len(slots) == BS and None not in slots
        for (kind, slots) in tier.bodies.values()
        if kind == "kv"
    )
    decode = Side.build(tier, role="decode")
    decode.scheduler.add_request(msg)
    await decode.run()
    (load,) = [t for plan in decode.plans for t in plan.kv_loads]
    ring_ids = [b for g, b in zip(load.groups, load.block_ids, strict=True) if g == RING_G]
    assert len(ring_ids) == N_RING == len(set(ring_ids))  # three chunks, three entries
    assert load.groups.count(FULL) == handed and load.groups.count(STATE_G) == 1
    assert decode.connector.stats.external_hit_tokens == handed * BS
    assert decode.worker.ring_positions_read > 0  # the resume read the loaded ring
    assert decode.client.outputs["a"] == [token_at("a", len(PROMPT) + i) for i in range(5)]
    assert all(not plan.kv_stores for plan in decode.plans)


def assert_ring_bodies_hold_their_chunks(side: Side, tier: StateTier, prompt: list[int]) -> None:
    """Every ring chunk in the tier holds exactly the tokens of the positions it names."""
    for t in (t for plan in side.plans for t in plan.kv_stores):
        ends = dict(side.connector.recorded(t.request_id))
        for key, group in zip(t.keys, t.groups, strict=True):
            if group == RING_G:
                end = ends[SPACE.parse(key)]
                assert tier.bodies[key] == ("kv", prompt[end - BS : end]), end


async def test_a_ring_chunk_overwritten_before_its_offer_is_never_stored() -> None:
    """14-token steps: the first step computes positions 0..13, and 12..13 (block 3) reuse
    chunk 0's ring entry, so chunk 0, full and inside the store mask of a hit at 3 chunks,
    no longer holds its positions and is not offered."""
    tier = StateTier()
    pre = await prefill(submit("a", PROMPT, max_tokens=2), tier, 3, 14)
    stored = ring_chunks_stored(pre)
    assert 0 not in stored and {1, 2} <= set(stored)
    assert_ring_bodies_hold_their_chunks(pre, tier, PROMPT)


async def test_role_both_never_stores_or_probes_a_ring_chunk() -> None:
    tier = StateTier()
    side = Side.build(tier, role="both")
    for rid in ("a", "b"):
        side.scheduler.add_request(submit(rid, PROMPT, max_tokens=3))
        await side.run()
    assert {g for plan in side.plans for t in plan.kv_stores for g in t.groups} == {FULL}
    assert all(not plan.kv_loads for plan in side.plans)
    assert {SPACE.parse(k).group for k in tier.payloads} == {FULL}
    assert {key.group for key in side.lookup.states} <= {FULL}
