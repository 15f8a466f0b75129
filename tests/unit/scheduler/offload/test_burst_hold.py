"""A shared prefix inside a burst is read from the tier once: requests whose next block another
request is loading wait for that load (HOLD) and then take its blocks as a local prefix hit.
Holding allocates nothing (every allocation still equals its estimate), lets requests that do
not share the prefix go ahead, ends when the load fails, and is bounded."""

from __future__ import annotations

import random

from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import BLOCK, CheckedAllocations, OffloadRig, Tier
from tests.unit.scheduler.worker_double import token_at

PREFIX_BLOCKS = 6


def prompts(n: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 5000) for _ in range(PREFIX_BLOCKS * BLOCK)]
    suffixes = [[rng.randrange(1000, 5000) for _ in range(BLOCK + 3)] for _ in range(n)]
    return prefix, [prefix + s for s in suffixes]


async def tier_with(prefix: list[int]) -> Tier:
    """A tier holding `prefix`'s blocks (a first mesh stored them; this one starts cold)."""
    rig = OffloadRig.build(num_gpu_blocks=200)
    rig.scheduler.add_request(submit("w", [*prefix, 7], max_tokens=1))
    await rig.run()
    assert len(rig.tier.payloads) == PREFIX_BLOCKS
    return rig.tier


def loaded_chunks(rig: OffloadRig) -> int:
    return sum(len(t.keys) for plan in rig.plans for t in plan.kv_loads)


def computed_tokens(rig: OffloadRig) -> int:
    return sum(sum(plan.num_scheduled_tokens.values()) for plan in rig.plans)


async def test_a_burst_reads_its_shared_prefix_once_and_computes_only_its_suffixes() -> None:
    prefix, burst = prompts(8)
    rig = OffloadRig.build(await tier_with(prefix), num_gpu_blocks=200, max_num_batched_tokens=256)
    checked = CheckedAllocations(rig.scheduler.kv)
    for k, prompt in enumerate(burst):
        rig.scheduler.add_request(submit(f"r{k}", prompt, max_tokens=3))
    await rig.run()
    assert loaded_chunks(rig) == PREFIX_BLOCKS  # once, not once per request
    assert rig.connector.stats.holds >= 7
    # Each request computes its suffix (and r0 nothing of the prefix): 8 x 7 prompt tokens,
    # plus the 2 decode positions of each.
    assert computed_tokens(rig) == 8 * (BLOCK + 3) + 8 * 2
    hits = {rid: delta.num_cached_tokens for rid, delta in rig.client.first.items()}
    assert hits == {f"r{k}": PREFIX_BLOCKS * BLOCK for k in range(8)}
    for k, prompt in enumerate(burst):  # the WorkerDouble checked every hit block's tokens
        assert rig.client.outputs[f"r{k}"] == [token_at(f"r{k}", len(prompt) + i) for i in range(3)]
    assert checked.pairs and all(estimate == taken for estimate, taken in checked.pairs)
    assert rig.scheduler.kv.num_free_blocks == rig.scheduler.kv.num_usable_blocks


async def test_outputs_equal_a_sequential_run() -> None:
    prefix, burst = prompts(4, seed=5)
    together = OffloadRig.build(await tier_with(prefix), num_gpu_blocks=200)
    for k, prompt in enumerate(burst):
        together.scheduler.add_request(submit(f"r{k}", prompt, max_tokens=4))
    await together.run()
    alone = OffloadRig.build(await tier_with(prefix), num_gpu_blocks=200)
    for k, prompt in enumerate(burst):
        alone.scheduler.add_request(submit(f"r{k}", prompt, max_tokens=4))
        await alone.run()
    assert together.client.outputs == alone.client.outputs
    assert loaded_chunks(together) == loaded_chunks(alone) == PREFIX_BLOCKS


async def test_requests_without_the_prefix_are_not_held_behind_it() -> None:
    prefix, (first, second) = prompts(2)
    rig = OffloadRig.build(await tier_with(prefix), num_gpu_blocks=200)
    rig.scheduler.add_request(submit("a", first, max_tokens=2))
    rig.scheduler.add_request(submit("b", second, max_tokens=2))
    rig.scheduler.add_request(submit("x", [9] * 9, max_tokens=2))  # shares nothing
    await rig.probe()
    plan = rig.step()
    assert plan is not None
    assert [t.request_id for t in plan.kv_loads] == ["a"]
    assert set(plan.num_scheduled_tokens) == {"x"}  # b held, x went past it
    assert [r.request_id for r in rig.scheduler.waiting] == ["b"]  # b keeps its place
    rig.answer_loads(plan)
    await rig.run()
    assert rig.client.first["b"].num_cached_tokens == PREFIX_BLOCKS * BLOCK


async def test_a_failed_load_releases_the_requests_it_held() -> None:
    prefix, (first, second) = prompts(2)
    rig = OffloadRig.build(await tier_with(prefix), num_gpu_blocks=200)
    rig.scheduler.add_request(submit("a", first, max_tokens=2))
    rig.scheduler.add_request(submit("b", second, max_tokens=2))
    await rig.probe()
    plan = rig.step()
    assert plan is not None and [t.request_id for t in plan.kv_loads] == ["a"]
    rig.answer_loads(plan, fail=set(rig.tier.payloads))  # the tier lost the prefix
    assert not rig.connector.producing
    await rig.run()
    assert rig.client.finish == {"a": "length", "b": "length"}
    assert loaded_chunks(rig) == PREFIX_BLOCKS  # nobody read the failed keys again


async def test_holding_is_bounded() -> None:
    prefix, (first, second) = prompts(2)
    rig = OffloadRig.build(await tier_with(prefix), num_gpu_blocks=200)
    rig.connector.max_holds = 2
    rig.scheduler.add_request(submit("a", first, max_tokens=2))
    rig.scheduler.add_request(submit("b", second, max_tokens=2))
    await rig.probe()
    load_a = rig.step()  # a's load goes out and is never answered
    assert load_a is not None and load_a.kv_loads
    assert rig.scheduler.schedule() is None  # b held (2nd time)
    plan = rig.scheduler.schedule()  # held twice: b goes its own way, loading the prefix too
    assert plan is not None and [t.request_id for t in plan.kv_loads] == ["b"]
    assert rig.connector.requests["b"] is rig.scheduler.get_request("b")
