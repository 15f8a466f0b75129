"""P/D for a hybrid model (full attention + a recurrent-state group): "transferable is not
storable". Under a prefill or decode role the state group takes part in the handoff (the
prefill side stores the state block at the end of each offer, the decode side loads the one
ending at its hit); under role "both" the tier stays attention-only.

Both sides run a GroupWorker, which checks every state read (the state at the resume point
must be exactly the state after the prompt's first n tokens); the transfer double moves each
group's chunk between the two workers' per-block contents (K/V slots or states) through a dict
standing for Redis.
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
from shared.config import SchedulerSettings
from shared.kv.groups import STATE, KVGroupSpec
from shared.protocol import StepPlan, SubmitRequest, WorkerReady
from tests.unit.scheduler.driver import ClientView, submit
from tests.unit.scheduler.group_worker import GroupWorker
from tests.unit.scheduler.offload.harness import SPACE, Tier
from tests.unit.scheduler.test_state_group import groups
from tests.unit.scheduler.worker_double import token_at

BS = 4
PROMPT = list(range(300, 323))  # 23 tokens: N = 3 hands over 20 = 5 blocks


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


def hybrid_config() -> SchedulerConfig:
    return SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=64,
        num_state_blocks=24,  # the worker's layout: state ids index a state pool of their own
        max_num_batched_tokens=8,  # the prefill runs in several steps (boundaries mid-step)
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
    def build(cls, tier: StateTier, *, role: str) -> Side:
        cfg = hybrid_config()
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
        return cls(scheduler, GroupWorker(BS, [None, STATE]), lookup, tier)

    @property
    def connector(self) -> OffloadConnector:
        assert self.scheduler.offload is not None
        return self.scheduler.offload

    def store(self, plan: StepPlan) -> None:
        """The worker's stores after the step: each chunk's block contents into the tier."""
        for t in plan.kv_stores:
            for key, group, block in zip(t.keys, t.groups, t.block_ids, strict=True):
                if group == 1:
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
                    assert kind == ("state" if group == 1 else "kv")
                    if group == 1:
                        assert isinstance(body, tuple)
                        self.worker.states[(group, block)] = body
                    else:
                        assert isinstance(body, list)
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


async def prefill(msg: SubmitRequest, tier: StateTier, lookahead: int = 3) -> Side:
    side = Side.build(tier, role="prefill")
    job = PrefillPolicy(lookahead, BS).job_for(msg)
    assert job is not None
    side.scheduler.add_request(job)
    for _ in range(100):
        plan = await side.step()
        assert plan is not None
        if prefilled_in_step(plan, {msg.request_id: len(job.prompt_token_ids)}):
            return side
    raise AssertionError("never prefilled")


def stored_groups(side: Side) -> list[tuple[int, int]]:
    """(group, chunk end in blocks) of every chunk the side's plans stored."""
    out = []
    for plan in side.plans:
        for t in plan.kv_stores:
            for key, group in zip(t.keys, t.groups, strict=True):
                chunks = dict(side.connector.recorded(t.request_id))
                end = chunks[SPACE.parse(key)] // BS
                out.append((group, end))
    return out


def test_the_state_group_takes_part_only_under_pd_roles() -> None:
    cfg = hybrid_config()
    lookup = AsyncLookup(Tier().verdicts)
    both = OffloadConnector(cfg, SPACE, lookup, "b")
    assert both.groups == [0] and not both.loads_supported
    for role in ("prefill", "decode"):
        pd = OffloadConnector(cfg, SPACE, lookup, role, transfer_state=True)
        assert pd.groups == [0, 1] and pd.state_groups == [1] and pd.loads_supported
        state = pd.windows[1]
        assert list(state.chunks(0, 5)) == [4]  # a hit of 5 blocks reads the state ending at it
        assert state.worth_storing(5) == [False, False, False, False, True]


def test_from_worker_serves_pd_roles_for_a_hybrid() -> None:
    ready = WorkerReady(
        worker_id="w", incarnation="i", model="m", num_kv_blocks=64, block_size=BS,
        vocab_size=1000, max_model_len=64, eos_token_ids=[2],
        kv_groups=[
            KVGroupSpec(kind="full", layer_indices=[1]),
            KVGroupSpec(kind="state", layer_indices=[0, 2]),
        ],
    )  # fmt: skip
    for role in ("prefill", "decode", "both"):
        config = SchedulerConfig.from_worker(SchedulerSettings(role=role), ready)
        assert [type(g.spec).__name__ for g in config.kv_cache_groups] == [
            "FullAttentionSpec",
            "StateSpec",
        ]


async def test_role_both_never_stores_or_loads_a_state_chunk() -> None:
    tier = StateTier()
    side = Side.build(tier, role="both")
    side.scheduler.add_request(submit("a", PROMPT, max_tokens=3))
    await side.run()
    side.scheduler.add_request(submit("b", PROMPT, max_tokens=3))
    await side.run()
    groups_stored = {g for plan in side.plans for t in plan.kv_stores for g in t.groups}
    assert groups_stored == {0}
    assert all(not plan.kv_loads for plan in side.plans)
    assert all(SPACE.parse(k).group == 0 for k in tier.payloads)


@pytest.mark.parametrize("lookahead", [3, 1])
async def test_prefill_hands_over_the_state_at_its_end_and_decode_resumes_from_it(
    lookahead: int,
) -> None:
    tier = StateTier()
    msg = submit("a", PROMPT, max_tokens=4)
    pre = await prefill(msg, tier, lookahead)
    handed = len(PROMPT) - max(1, lookahead)  # 20 or 22 tokens: 5 full blocks either way
    stored = stored_groups(pre)
    assert sorted(e for g, e in stored if g == 0) == [1, 2, 3, 4, 5]
    state_ends = sorted(e for g, e in stored if g == 1)
    assert state_ends and state_ends[-1] == handed // BS  # the state at the handed-over end
    assert all(SPACE.parse(k).group == (kind == "state") for k, (kind, _) in tier.bodies.items())
    decode = Side.build(tier, role="decode")
    decode.scheduler.add_request(msg)
    await decode.run()
    (load,) = [t for plan in decode.plans for t in plan.kv_loads]
    assert load.groups.count(0) == 5  # every attention chunk of the hit
    assert load.groups.count(1) == 1  # one state chunk: the one ending at the hit
    (state_key,) = [k for k, g in zip(load.keys, load.groups, strict=True) if g == 1]
    assert tier.bodies[state_key] == ("state", tuple(PROMPT[: 5 * BS]))
    assert decode.connector.stats.external_hit_tokens == 5 * BS
    assert decode.worker.states_read > 0  # the resume read the loaded state (checked there)
    assert decode.client.outputs["a"] == [token_at("a", len(PROMPT) + i) for i in range(4)]
    assert all(not plan.kv_stores for plan in decode.plans)  # a consumer stores nothing


async def test_a_decode_hit_without_its_state_chunk_is_shortened_to_the_last_stored_state() -> None:
    tier = StateTier()
    msg = submit("a", PROMPT, max_tokens=3)
    pre = await prefill(msg, tier)
    state_ends = sorted(e for g, e in stored_groups(pre) if g == 1)
    assert len(state_ends) >= 2, state_ends  # several offers: several state chunks
    last = [k for k in tier.payloads if SPACE.parse(k).group == 1]
    # Drop the state chunk at the handed-over end: the hit falls back to the previous one.
    ends = {k: e for k, e in pre.connector.recorded("a") if k.group == 1}
    dropped = max(ends, key=lambda k: ends[k])
    tier.drop(SPACE.payload_key(dropped))
    assert len(last) == len(state_ends)
    decode = Side.build(tier, role="decode")
    decode.scheduler.add_request(msg)
    await decode.run()
    assert decode.connector.stats.external_hit_tokens == state_ends[-2] * BS
    assert decode.worker.states_read > 0
    assert decode.client.outputs["a"] == [token_at("a", len(PROMPT) + i) for i in range(3)]


async def test_a_decode_side_without_any_state_chunk_recomputes() -> None:
    tier = StateTier()
    msg = submit("a", PROMPT, max_tokens=3)
    await prefill(msg, tier)
    for key in [k for k in tier.payloads if SPACE.parse(k).group == 1]:
        tier.drop(key)
    decode = Side.build(tier, role="decode")
    decode.scheduler.add_request(msg)
    await decode.run()
    assert all(not plan.kv_loads for plan in decode.plans)
    assert decode.connector.stats.external_hit_tokens == 0
    assert decode.client.outputs["a"] == [token_at("a", len(PROMPT) + i) for i in range(3)]
