"""A ring-buffer group beside full attention and a recurrent-state group (CONTRACTS.md,
"Transferable is not storable"): the slot rule (position p in entry (p // bs) % n), a table
that stops at n = ceil(ring_size / bs) blocks, estimate == allocation on every path, no prefix
hit ever (a ring entry holds whichever position was written last, which no hash names), and
whole runs under preemption where GroupWorker checks every ring read while the offload tier
never stores, hashes or looks up a ring block."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from services.scheduler.config import SchedulerConfig, kv_cache_groups_from
from services.scheduler.kv.block_pool import BlockPool
from services.scheduler.kv.kv_cache_coordinator import KVCacheCoordinator
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.kv.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    RingSpec,
    StateSpec,
)
from services.scheduler.kv.single_type_manager import RingManager, make_manager
from services.scheduler.offload.async_lookup import AsyncLookup
from services.scheduler.offload.connector import OffloadConnector, transfer_projection
from services.scheduler.offload.load_allocation import allocate_for_load, blocks_for_load
from services.scheduler.offload.store_admission import StoreAdmission
from services.scheduler.offload.verdict import Verdict
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerSettings
from shared.kv.groups import STATE, KVGroupSpec, Ring, kv_groups_for
from shared.kv.offload_key import OffloadKey
from shared.protocol import WorkerReady
from tests.unit.scheduler.driver import ClientView, submit
from tests.unit.scheduler.group_worker import GroupWorker
from tests.unit.scheduler.offload.harness import SPACE, Tier
from tests.unit.scheduler.test_hybrid_kv_cache import (
    BS,
    allocate_checked,
    blocks_taken,
    cache,
    expected,
    hashes,
    request,
)

RING = 10  # not a multiple of BS: the ring is 3 blocks (12 slots)
N_RING = -(-RING // BS)
FULL, RING_G, STATE_G = 0, 1, 2  # kv_groups_for's order: full, ring, state
LAYERS = [None, Ring(RING), STATE, None, Ring(RING)]


def groups() -> list[KVCacheGroup]:
    return kv_cache_groups_from(kv_groups_for(LAYERS), BS)


LAYOUTS = pytest.mark.parametrize("state_blocks", [0, 40], ids=["one-pool", "state-pool"])


def manager(num_gpu_blocks: int = 200, state_blocks: int = 0) -> KVCacheManager:
    return KVCacheManager(
        SchedulerConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            num_state_blocks=state_blocks,
            max_num_batched_tokens=64,
            kv_cache_groups=groups(),
        )
    )


# ------------------------------------------------------------------- the ring manager alone


@pytest.mark.parametrize(("ring_size", "n"), [(10, 3), (8, 2), (1, 1), (13, 4)])
def test_ring_table_reaches_n_blocks_and_never_grows(ring_size: int, n: int) -> None:
    pool = BlockPool(32)
    ring = make_manager(RingSpec(block_size=BS, ring_size=ring_size), pool, 0, True)
    assert isinstance(ring, RingManager) and ring.n_ring_blocks == n
    held: list[int] = []
    for num_tokens in range(1, 60):
        estimate = ring.get_num_blocks_to_allocate("r", num_tokens, [])
        free = pool.num_free_blocks
        new = ring.allocate_new_blocks("r", num_tokens)
        assert len(new) == estimate == free - pool.num_free_blocks
        held += [b.block_id for b in new]
        assert len(ring.blocks_of("r")) == min(-(-num_tokens // BS), n)
        assert ring.max_blocks_held(num_tokens, 64) == len(ring.blocks_of("r"))
    assert [b.block_id for b in ring.blocks_of("r")] == held and len(set(held)) == n
    ring.free("r")
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_slot_rule_maps_position_p_to_entry_p_div_bs_mod_n() -> None:
    ring = make_manager(RingSpec(block_size=BS, ring_size=RING), BlockPool(8), 0, True)
    assert isinstance(ring, RingManager)
    assert [ring.entry_of(p) for p in range(0, 28, BS)] == [0, 1, 2, 0, 1, 2, 0]
    assert [ring.entry_of(p) for p in (3, 11, 12, 13, 47, 48)] == [0, 2, 0, 0, 2, 0]
    # Every window of the last RING positions maps to distinct slots (no self-overwrite).
    for q in range(RING, 80):
        slots = {(ring.entry_of(p), p % BS) for p in range(q - RING + 1, q + 1)}
        assert len(slots) == RING


def test_a_ring_never_registers_or_serves_a_hit() -> None:
    pool = BlockPool(32)
    ring = make_manager(RingSpec(block_size=BS, ring_size=RING), pool, 0, True)
    h = hashes(8)
    ring.allocate_new_blocks("r", 32)
    assert ring.cache_blocks("r", h, 32) == []
    assert pool.cached == {}
    assert ring.find_longest_cache_hit(h, 32) == []
    spec = RingSpec(block_size=BS, ring_size=RING)
    assert not spec.prefix_cacheable and not spec.locally_cacheable and spec.transferable


def test_a_ring_group_makes_every_coordinator_hit_zero() -> None:
    """Full attention and the state group both could serve 4 blocks; the ring cannot serve
    any, so the model's hit is 0 (the ring's contents at block 4 were never kept)."""
    pool = BlockPool(64)
    h = hashes(6)
    cache(pool, h, FULL, {0, 1, 2, 3, 4, 5})
    cache(pool, h, STATE_G, {3})
    coordinator = KVCacheCoordinator(groups(), pool, enable_caching=True)
    assert coordinator.find_longest_cache_hit(h, 6 * BS) == ([[], [], []], 0)
    # Without the ring the same cache serves the state boundary at 4 blocks.
    no_ring = [g for g in groups() if not isinstance(g.spec, RingSpec)]
    pool2 = BlockPool(64)
    cache(pool2, h, 0, {0, 1, 2, 3, 4, 5})
    cache(pool2, h, 1, {3})
    _, num = KVCacheCoordinator(no_ring, pool2, enable_caching=True).find_longest_cache_hit(
        h, 6 * BS
    )
    assert num == 4 * BS


# ------------------------------------------------------------------ estimate == allocation


@LAYOUTS
def test_chunked_prefill_and_long_decode_hold_n_ring_blocks(state_blocks: int) -> None:
    kv = manager(state_blocks=state_blocks)
    req = request("a", list(range(30)))
    free = kv.num_free_blocks
    for chunk in (3, 4, 9, 14):
        allocate_checked(kv, req, chunk)
        ring = kv.coordinator.get_blocks("a")[RING_G]
        assert len(ring) == min(-(-req.num_computed_tokens // BS), N_RING)
    for i in range(40):
        req.append_output_token(2000 + i)
        allocate_checked(kv, req, 1)
    full, ring, state = kv.coordinator.get_blocks("a")
    assert len(full) == -(-70 // BS) and len(ring) == N_RING
    held = len(full) + len(ring) + sum(not b.is_null for b in state)
    assert free - kv.num_free_blocks == held
    kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_prompt_cached_by_another_request_still_gets_no_hit() -> None:
    kv = manager()
    prompt = list(range(500, 532))
    first = request("a", [*prompt, 1])
    allocate_checked(kv, first, 33)
    first.append_output_token(5)
    allocate_checked(kv, first, 1)
    assert all(key[1] != RING_G for key in kv.pool.cached)
    assert any(key[1] == FULL for key in kv.pool.cached)  # full attention did register
    second = request("b", [*prompt, 2])
    hit, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 0 and hit == [[], [], []]
    # Full 9, ring 3, state 9 (all its entries until the next allocation drops the earlier).
    assert allocate_checked(kv, second, 33, hit, num_hit) == 9 + N_RING + 9


def test_load_then_resume_estimates_equal_allocations() -> None:
    """The P/D decode path: blocks for a load of 20 tokens (no local hit, a ring never has
    one), then the resumed admission of 3 more tokens counting the loaded ones."""
    kv = manager()
    req = request("a", list(range(23)))
    no_hit = kv.empty_blocks()
    estimate = blocks_for_load(kv, req, no_hit, 0, 20)
    with blocks_taken(kv) as taken:
        assert allocate_for_load(kv, req, no_hit, 0, 20) is not None
    assert sum(len(t) for t in taken) == estimate == 5 + N_RING + 5
    assert len(kv.coordinator.get_blocks("a")[RING_G]) == N_RING
    allocate_checked(kv, req, 3, None, 20)
    assert len(kv.coordinator.get_blocks("a")[RING_G]) == N_RING


@pytest.mark.parametrize("prompt_len", [1, 4, 10, 13, 200])
def test_admission_bound_counts_the_ring_by_its_n_blocks(prompt_len: int) -> None:
    kv = KVCacheManager(
        SchedulerConfig.from_worker(SchedulerSettings(max_num_batched_tokens=16), ready())
    )
    blocks = -(-prompt_len // BS)
    # full: ceil(n / 4); ring: min(ceil(n / 4), 3); state: ceil((1 + 16) / 4) + 1 = 6 at most.
    assert kv.num_blocks_for_tokens(prompt_len) == blocks + min(blocks, N_RING) + min(blocks, 6)


# ----------------------------------------------------------------------- config and start-up


def ready(num_kv_blocks: int = 64) -> WorkerReady:
    return WorkerReady(
        worker_id="w", incarnation="i", model="m", num_kv_blocks=num_kv_blocks, block_size=BS,
        vocab_size=1000, max_model_len=256, eos_token_ids=[2], kv_groups=kv_groups_for(LAYERS),
    )  # fmt: skip


def test_a_full_state_ring_config_starts_with_groups_in_the_workers_order() -> None:
    assert [(g.kind, g.ring_size, g.layer_indices) for g in kv_groups_for(LAYERS)] == [
        ("full", None, [0, 3]),
        ("ring", RING, [1, 4]),
        ("state", None, [2]),
    ]
    for role in ("both", "prefill", "decode"):
        config = SchedulerConfig.from_worker(SchedulerSettings(role=role), ready())
        specs = [g.spec for g in config.kv_cache_groups]
        assert [type(s) for s in specs] == [FullAttentionSpec, RingSpec, StateSpec]
        assert isinstance(specs[RING_G], RingSpec) and specs[RING_G].ring_size == RING
        Scheduler(config, role)


def test_ring_group_specs_are_validated() -> None:
    with pytest.raises(ValueError, match="ring size"):
        KVGroupSpec(kind="ring", layer_indices=[0])
    with pytest.raises(ValueError, match="ring size"):
        KVGroupSpec(kind="full", ring_size=8, layer_indices=[0])
    with pytest.raises(ValueError, match="must be >= 1"):
        kv_groups_for([Ring(0)])
    with pytest.raises(ValueError, match="speculative decoding with a ring"):
        SchedulerConfig(block_size=BS, num_spec_tokens=2, kv_cache_groups=groups())


# ------------------------------------------------------------ whole runs through the scheduler


@dataclass
class ProbeRecorder(Tier):
    """The tier, remembering every key the scheduler's lookups probed."""

    probed: list[OffloadKey] = field(default_factory=list)

    async def verdicts(self, keys: list[OffloadKey]) -> dict[OffloadKey, Verdict]:
        self.probed += keys
        return await super().verdicts(keys)


@contextmanager
def checked_allocations(kv: KVCacheManager) -> Iterator[list[int]]:
    """Every `allocate_slots` the scheduler makes: its estimate (per pool) must equal the
    blocks it takes, and nothing when it refuses. Yields the count of checked calls."""
    calls = [0]
    allocate = kv.allocate_slots

    def checked(*args, **kwargs):  # type: ignore[no-untyped-def]
        estimate = kv.blocks_to_allocate(*args, **kwargs)
        with blocks_taken(kv) as taken:
            out = allocate(*args, **kwargs)
        got = [len(t) for t in taken]
        assert got == (estimate if out is not None else [0] * len(got)), (estimate, got)
        calls[0] += 1
        return out

    kv.allocate_slots = checked  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        kv.allocate_slots = allocate  # type: ignore[method-assign]


@LAYOUTS
def test_requests_around_the_ring_size_run_to_completion_under_preemption(
    state_blocks: int,
) -> None:
    """Prompts shorter and longer than the ring (some sharing a prefix) in a pool too small
    for all: every ring read is checked by GroupWorker, a request never holds more than n ring
    blocks, every allocation equals its estimate, no hit is ever served, the tier never hears
    of a ring (or state) block, and every block comes back at the end."""
    config = SchedulerConfig(
        block_size=BS,
        num_gpu_blocks=40,
        num_state_blocks=state_blocks,
        max_num_batched_tokens=16,
        max_model_len=256,
        kv_cache_groups=groups(),
    )
    sched = Scheduler(config, "s")
    tier = ProbeRecorder()
    lookup = AsyncLookup(tier.verdicts, max_pending_s=2.0)
    connector = OffloadConnector(
        config, SPACE, lookup, "t", store_admission=StoreAdmission("always")
    )
    sched.offload = connector
    assert connector.groups == [FULL] and not connector.loads_supported
    worker = GroupWorker(BS, [None, Ring(RING), STATE])
    shared = list(range(300, 316))
    prompts = {
        "a": list(range(10, 13)),  # below the ring
        "b": list(range(20, 30)),  # exactly the ring
        "c": [*shared, 7],  # above: 17
        "d": [*shared, *range(40, 63)],  # 39, shares c's prefix
        "e": list(range(80, 91)),  # 11
        "f": [*shared, 9, 9],
    }
    max_tokens = {"a": 30, "b": 6, "c": 20, "d": 25, "e": 12, "f": 18}
    for rid, prompt in prompts.items():
        sched.add_request(submit(rid, prompt, max_tokens=max_tokens[rid]))
    client = ClientView()
    stored: list[int] = []
    with checked_allocations(sched.kv) as calls:
        while (plan := sched.schedule()) is not None:
            stored += [g for t in plan.kv_stores for g in t.groups]
            assert not plan.kv_loads
            for rid in plan.num_scheduled_tokens:
                ring = sched.kv.coordinator.get_blocks(rid)[RING_G]
                assert 0 < len(ring) <= N_RING
            assert all(key[1] != RING_G for key in sched.kv.pool.cached)
            for stream, deltas in sched.update_from_output(plan, worker.run(plan)).deltas.items():
                for delta in deltas:
                    client.apply(stream, delta)
            asyncio.run(_flush(lookup))
    assert not sched.has_work()
    for rid, prompt in prompts.items():
        assert client.outputs[rid] == expected(rid, len(prompt), max_tokens[rid])
    assert sched.num_preemptions > 0
    assert calls[0] > 0 and worker.ring_positions_read > 0
    assert sched.kv.stats.hits == 0  # shared prefixes, and still no hit: the ring has none
    assert stored and set(stored) == {FULL}
    assert tier.probed and {k.group for k in tier.probed} == {FULL}
    assert all(SPACE.parse(k).group == FULL for k in tier.payloads)
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


async def _flush(lookup: AsyncLookup) -> None:
    await asyncio.gather(*lookup.flush())


def test_the_transfer_projection_ships_ring_blocks_only_under_pd() -> None:
    config = SchedulerConfig.from_worker(SchedulerSettings(), ready())
    assert transfer_projection(config, transfer_state=False) == [FULL]
    assert transfer_projection(config, transfer_state=True) == [FULL, RING_G, STATE_G]
    pd = OffloadConnector(config, SPACE, AsyncLookup(Tier().verdicts), "p", transfer_state=True)
    assert pd.groups == [FULL, RING_G, STATE_G] and pd.loads_supported
    assert pd.ring_blocks == {RING_G: N_RING}
    # A hit of 7 chunks needs the ring's last RING - 1 = 9 positions: chunks 4..6.
    assert list(pd.windows[1].chunks(0, 7)) == [4, 5, 6]
