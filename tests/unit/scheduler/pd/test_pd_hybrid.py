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

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector
from shared.config import SchedulerSettings
from shared.kv.groups import STATE, KVGroupSpec
from shared.protocol import SubmitRequest, WorkerReady
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import SPACE, Tier
from tests.unit.scheduler.pd.group_sides import Side, StateTier
from tests.unit.scheduler.test_state_group import groups
from tests.unit.scheduler.worker_double import token_at

BS = 4
PROMPT = list(range(300, 323))  # 23 tokens: N = 3 hands over 20 = 5 blocks


def hybrid_config() -> SchedulerConfig:
    return SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=64,
        num_state_blocks=24,  # the worker's layout: state ids index a state pool of their own
        max_num_batched_tokens=8,  # the prefill runs in several steps (boundaries mid-step)
        max_model_len=200,
        kv_cache_groups=groups(),
    )


def make_side(tier: StateTier, role: str) -> Side:
    return Side.build(tier, hybrid_config(), [None, STATE], state_group=1, role=role)


async def prefill(msg: SubmitRequest, tier: StateTier, lookahead: int = 3) -> Side:
    return await make_side(tier, "prefill").prefill(msg, lookahead)


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
    side = make_side(tier, "both")
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
    decode = make_side(tier, "decode")
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
    decode = make_side(tier, "decode")
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
    decode = make_side(tier, "decode")
    decode.scheduler.add_request(msg)
    await decode.run()
    assert all(not plan.kv_loads for plan in decode.plans)
    assert decode.connector.stats.external_hit_tokens == 0
    assert decode.client.outputs["a"] == [token_at("a", len(PROMPT) + i) for i in range(3)]
