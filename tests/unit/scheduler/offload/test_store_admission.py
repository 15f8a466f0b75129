"""The store admission policy: store on second sight ("reuse"), or every chunk ("always"); a
chunk known to be in the tier is only recorded; inside the scheduler a workload that never
reuses a prompt writes nothing, and a shared prefix is written once."""

from __future__ import annotations

import random

import pytest

from services.scheduler.offload.store_admission import StoreAdmission, StoreDecision
from shared.kv.block_hash import extend_block_hashes
from shared.kv.offload_key import OffloadKey
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, SPACE, OffloadRig

WRITE, RECORD, SKIP = StoreDecision.WRITE, StoreDecision.RECORD, StoreDecision.SKIP


def test_reuse_writes_on_the_second_sight_by_another_request_then_only_records() -> None:
    policy = StoreAdmission("reuse")
    assert policy.decide("k", "a") is SKIP  # first sight: remembered only
    assert policy.decide("k", "a") is SKIP  # the same request again is not a reuse
    assert policy.decide("k", "b") is WRITE
    assert policy.decide("k", "c") is RECORD  # being written (or written): not again
    assert (policy.stats.write, policy.stats.record, policy.stats.skip) == (1, 1, 2)


def test_always_writes_every_new_chunk_once() -> None:
    policy = StoreAdmission("always")
    assert [policy.decide(k, "a") for k in "xyz"] == [WRITE] * 3
    assert policy.decide("x", "b") is RECORD


def test_a_failed_write_is_written_again_at_the_next_offer() -> None:
    policy = StoreAdmission("reuse")
    policy.decide("k", "a")
    assert policy.decide("k", "b") is WRITE
    policy.mark_missing(["k"])  # its write failed, or the tier lost it
    assert not policy.knows_stored("k")
    assert policy.decide("k", "c") is WRITE  # its reuse is established: no new first sight


def test_keys_found_in_the_tier_are_only_recorded() -> None:
    policy = StoreAdmission("reuse")
    policy.mark_stored(["k"])  # a load read it
    assert policy.decide("k", "a") is RECORD


def test_both_memories_are_bounded() -> None:
    policy = StoreAdmission("reuse", max_keys=2)
    for key in "abc":
        policy.decide(key, "r1")
    assert policy.decide("a", "r2") is SKIP  # forgotten: the oldest first sight went
    assert policy.decide("c", "r2") is WRITE
    policy.mark_stored(["x", "y"])
    assert not policy.knows_stored("c") and policy.knows_stored("y")


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="store policy"):
        StoreAdmission("sometimes")  # type: ignore[arg-type]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 5000) for _ in range(n)]


def written(rig: OffloadRig) -> list[str]:
    return [key for plan in rig.plans for t in plan.kv_stores for key in t.keys]


async def test_a_workload_without_reuse_writes_nothing() -> None:
    rng = random.Random(1)
    rig = OffloadRig.build(store_policy="reuse", num_gpu_blocks=200)
    for k in range(6):
        rig.scheduler.add_request(submit(f"r{k}", random_prompt(rng, 30), max_tokens=6))
    await rig.run()
    assert written(rig) == [] and rig.tier.payloads == {}
    assert rig.connector.admission.stats.write == 0
    assert rig.connector.admission.stats.skip == 6 * 8  # 36 tokens: 8 full blocks each


async def test_a_shared_prefix_is_written_once_and_the_suffixes_never() -> None:
    rng = random.Random(2)
    prefix = random_prompt(rng, 5 * BLOCK)
    rig = OffloadRig.build(store_policy="reuse", num_gpu_blocks=200)
    for k in range(6):
        prompt = prefix + random_prompt(rng, 2 * BLOCK + 1)
        rig.scheduler.add_request(submit(f"r{k}", prompt, max_tokens=2))
    await rig.run()
    keys = written(rig)
    assert len(keys) == len(set(keys)) == 5  # the prefix's blocks, once each
    assert set(keys) == prompt_keys(prefix) == set(rig.tier.payloads)
    # Every later request reported the prefix for its recency, without writing it.
    assert rig.connector.admission.stats.record == 4 * 5


def prompt_keys(prompt: list[int]) -> set[str]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, BLOCK)
    return {SPACE.payload_key(OffloadKey(h, 0)) for h in hashes}
