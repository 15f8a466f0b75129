"""P/D for a model with full attention, a ring-buffer group and a recurrent-state group:
the handoff ships the ring ("transferable"), while role "both" never stores or looks one up.

The prefill side offers a ring chunk only while its ring entry still holds it (chunk i lives
in entry i % n until a later position reuses the entry); the decode side loads the ring chunks
a hit needs into entries i % n of its fresh ring and resumes. Both sides run a GroupWorker,
which checks every ring position a step reads against the tokens it stands for, so a chunk
written into the wrong entry, or stored after being overwritten, fails the run.
"""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from shared.kv.groups import STATE, Ring
from shared.protocol import SubmitRequest
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import SPACE
from tests.unit.scheduler.pd.group_sides import Side, StateTier
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


def make_side(tier: StateTier, role: str, step_tokens: int = 8) -> Side:
    layers = [None, Ring(RING), STATE]
    return Side.build(tier, config(step_tokens), layers, state_group=STATE_G, role=role)


async def prefill(msg: SubmitRequest, tier: StateTier, lookahead: int, step_tokens: int) -> Side:
    return await make_side(tier, "prefill", step_tokens).prefill(msg, lookahead)


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
    decode = make_side(tier, "decode")
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
    side = make_side(tier, "both")
    for rid in ("a", "b"):
        side.scheduler.add_request(submit(rid, PROMPT, max_tokens=3))
        await side.run()
    assert {g for plan in side.plans for t in plan.kv_stores for g in t.groups} == {FULL}
    assert all(not plan.kv_loads for plan in side.plans)
    assert {SPACE.parse(k).group for k in tier.payloads} == {FULL}
    assert {key.group for key in side.lookup.states} <= {FULL}
