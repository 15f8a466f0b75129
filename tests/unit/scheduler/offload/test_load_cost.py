"""The load cost model: a hit is loaded only when that beats recomputing it on this machine,
with the rates learned from the worker's own timings; inside the scheduler a slow tier makes
hits recompute (counted), and a request whose whole hit could not win is not looked up."""

from __future__ import annotations

import pytest

from services.scheduler.offload.load_cost import LoadCostModel
from tests.unit.scheduler.driver import submit
from tests.unit.scheduler.offload.harness import OffloadRig, Tier
from tests.unit.scheduler.offload.test_connector import PROMPT, keys_of, warm_tier

OTHER = list(range(300, 326))  # a prompt the tier does not hold


def test_loads_win_until_the_prefill_rate_is_known() -> None:
    model = LoadCostModel(load_bytes_per_s=1e6)
    assert model.recompute_seconds(1000) is None
    assert model.load_wins(1, 10**9)  # nothing to compare with: the tier is tried


def test_the_cheaper_side_wins_with_learned_rates() -> None:
    model = LoadCostModel(load_bytes_per_s=1e9, smoothing=1.0)
    model.observe_step(num_tokens=2000, seconds=1.0)  # 2,000 tokens/s prefill
    model.observe_step(num_tokens=8, seconds=1.0)  # 1 s decode steps
    model.observe_load(num_bytes=100 * 10**6, seconds=1.0)  # 100 MB/s measured
    assert model.prefill_tokens_per_s == 2000 and model.load_bytes_per_s == 100e6
    # 4,000 tokens recompute in 2 s; 50 MB load in 1 s step + 0.5 s.
    assert model.load_wins(4000, 50 * 10**6)
    # 1,000 tokens recompute in 0.5 s: a load can never beat that with a 1 s step to wait.
    assert not model.load_wins(1000, 1)


def test_decode_steps_teach_the_step_time_and_prefills_the_prefill_rate() -> None:
    model = LoadCostModel(smoothing=1.0, min_prefill_tokens=64)
    model.observe_step(num_tokens=8, seconds=0.05)
    assert model.prefill_tokens_per_s == 0 and model.step_s == 0.05
    model.observe_step(num_tokens=512, seconds=0.25)
    assert model.prefill_tokens_per_s == 2048 and model.step_s == 0.05


def test_rates_move_as_moving_averages() -> None:
    model = LoadCostModel(load_bytes_per_s=100.0, smoothing=0.5)
    model.observe_load(300, 1.0)
    assert model.load_bytes_per_s == pytest.approx(200.0)
    model.observe_load(0, 1.0)  # a load that moved nothing teaches nothing
    assert model.load_bytes_per_s == pytest.approx(200.0)


def rig_with_rates(tier: Tier, *, prefill: float, step_s: float, bytes_per_s: float) -> OffloadRig:
    """A rig whose cost model has learned these rates, with chunks of 1 MB."""
    rig = OffloadRig.build(tier)
    cost = rig.connector.cost
    cost.prefill_tokens_per_s, cost.step_s, cost.load_bytes_per_s = prefill, step_s, bytes_per_s
    rig.connector.chunk_bytes = 10**6
    return rig


async def test_a_tier_slower_than_recompute_is_not_even_looked_up() -> None:
    rig = rig_with_rates(await warm_tier(), prefill=1000, step_s=0.006, bytes_per_s=1e6)
    rig.scheduler.add_request(submit("b", PROMPT, max_tokens=2))
    probes = rig.tier.probes
    await rig.run()
    assert rig.tier.probes == probes  # no probe, and no step deferred for its answer
    assert all(not plan.kv_loads for plan in rig.plans)
    assert rig.connector.stats.defers == 0 and rig.connector.stats.external_hit_tokens == 0
    assert rig.connector.stats.lookups_skipped == 1
    assert rig.client.finish["b"] == "length"


async def test_a_short_hit_is_recomputed_and_a_long_one_loaded() -> None:
    """4 ms to recompute a chunk (4 tokens at 1,000/s), 1 ms to load one, plus a 6 ms step of
    the running batch (request "a") to wait for a load's answer: 6 chunks load (12 ms < 24 ms),
    1 chunk does not (7 ms > 4 ms)."""
    tier = await warm_tier()
    rig = rig_with_rates(tier, prefill=1000, step_s=0.006, bytes_per_s=1e9)
    rig.scheduler.add_request(submit("a", OTHER, max_tokens=8))
    rig.scheduler.add_request(submit("b", PROMPT, max_tokens=2))
    for key in keys_of(rig, "b", range(1, 6)):  # only the head chunk is left in the tier
        del tier.payloads[key]
    await rig.run()
    assert all(not plan.kv_loads for plan in rig.plans)
    assert (rig.connector.cost.stats.loads, rig.connector.cost.stats.computes) == (0, 1)

    rig = rig_with_rates(await warm_tier(), prefill=1000, step_s=0.006, bytes_per_s=1e9)
    rig.scheduler.add_request(submit("a", OTHER, max_tokens=8))
    rig.scheduler.add_request(submit("c", PROMPT, max_tokens=2))
    await rig.run()
    assert sum(len(t.keys) for plan in rig.plans for t in plan.kv_loads) == 6
    assert (rig.connector.cost.stats.loads, rig.connector.cost.stats.computes) == (1, 0)


async def test_an_idle_worker_loads_without_waiting_for_a_step() -> None:
    """The short hit above (1 ms to load, 4 ms to recompute) with nothing running: no decode
    step stands between the load and the request, so it loads."""
    tier = await warm_tier()
    rig = rig_with_rates(tier, prefill=1000, step_s=0.006, bytes_per_s=1e9)
    rig.scheduler.add_request(submit("b", PROMPT, max_tokens=2))
    for key in keys_of(rig, "b", range(1, 6)):
        del tier.payloads[key]
    await rig.run()
    assert sum(len(t.keys) for plan in rig.plans for t in plan.kv_loads) == 1
    assert (rig.connector.cost.stats.loads, rig.connector.cost.stats.computes) == (1, 0)
    assert rig.connector.stats.lookups_skipped == 0
