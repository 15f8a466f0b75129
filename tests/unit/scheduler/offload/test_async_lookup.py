"""Async lookups: one probe per key in flight, orphans reclaimed, stale and failed answers."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Hashable

import pytest

from services.scheduler.offload.async_lookup import AsyncLookup, Phase
from services.scheduler.offload.verdict import Verdict
from tests.unit.kvstore.prefix import prefix_keys


class GatedBackend:
    """A real async backend over a set of existing keys whose answers wait for `release`."""

    def __init__(self, existing: Collection[Hashable] = (), *, fail: bool = False) -> None:
        self.existing = set(existing)
        self.fail = fail
        self.calls: list[list[Hashable]] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, keys: list[Hashable]) -> dict[Hashable, Verdict]:
        self.calls.append(list(keys))
        self.started.set()
        await self.release.wait()
        if self.fail:
            raise ConnectionError("redis went away")
        return {k: Verdict.HIT for k in keys if k in self.existing}


async def test_a_later_request_attaches_to_the_probe_in_flight() -> None:
    (k,) = prefix_keys(1)
    backend = GatedBackend(existing=[k])
    lookup = AsyncLookup(backend)
    assert lookup.lookup("A", k) is Verdict.RETRY
    (task,) = lookup.flush()
    await backend.started.wait()
    lookup.request_finished("A")  # A gives up while its probe is in flight
    assert k in lookup.states  # kept: in flight
    assert lookup.lookup("B", k) is Verdict.RETRY
    assert lookup.flush() == []  # no second probe for K
    backend.release.set()
    await task
    assert lookup.lookup("B", k) is Verdict.HIT
    assert backend.calls == [[k]]


async def test_orphan_result_is_dropped_with_its_state() -> None:
    (k,) = prefix_keys(1)
    backend = GatedBackend(existing=[k])
    lookup = AsyncLookup(backend)
    lookup.lookup("A", k)
    (task,) = lookup.flush()
    lookup.request_finished("A")
    backend.release.set()
    await task
    assert lookup.states == {} and lookup.results_dropped == 1
    # A new request starts fresh: a new probe, not the dropped verdict.
    assert lookup.lookup("B", k) is Verdict.RETRY
    assert len(lookup.flush()) == 1


async def test_stale_generation_result_is_ignored() -> None:
    (k,) = prefix_keys(1)
    backend = GatedBackend(existing=[])
    lookup = AsyncLookup(backend)
    lookup.lookup("A", k)
    (old,) = lookup.flush()
    await backend.started.wait()
    lookup.invalidate([k])  # K was stored after the probe started: its "absent" is out of date
    backend.release.set()
    await old
    assert lookup.lookup("A", k) is Verdict.RETRY  # the stale answer was not taken
    assert lookup.results_dropped == 1
    backend.existing.add(k)
    (new,) = lookup.flush()
    await new
    assert lookup.lookup("A", k) is Verdict.HIT
    assert backend.calls == [[k], [k]]


async def test_forced_miss_sticks() -> None:
    (k,) = prefix_keys(1)
    backend = GatedBackend(existing=[k])
    lookup = AsyncLookup(backend)
    lookup.lookup("A", k)
    (task,) = lookup.flush()
    lookup.mark_load_failed([k])  # a load of K failed while a probe is in flight
    backend.release.set()
    await task
    assert lookup.lookup("A", k) is Verdict.MISS  # the probe said present; the failure wins
    lookup.invalidate([k])  # even a fresh probe that finds K does not lift the forced miss
    assert lookup.lookup("B", k) is Verdict.MISS
    tasks = lookup.flush()
    assert len(tasks) == 1
    await asyncio.gather(*tasks)
    assert lookup.lookup("B", k) is Verdict.MISS


async def test_a_backend_error_counts_as_misses() -> None:
    keys = prefix_keys(3)
    backend = GatedBackend(existing=keys, fail=True)
    backend.release.set()
    lookup = AsyncLookup(backend)
    for key in keys:
        lookup.lookup("A", key)
    (task,) = lookup.flush()
    await task
    assert [lookup.lookup("A", k) for k in keys] == [Verdict.MISS] * 3


async def test_one_flush_batches_all_pending_keys() -> None:
    keys = prefix_keys(5)
    backend = GatedBackend(existing=keys[:2])
    backend.release.set()
    lookup = AsyncLookup(backend, max_batch=3)
    for i, key in enumerate(keys):
        assert lookup.lookup(f"r{i % 2}", key) is Verdict.RETRY
    tasks = lookup.flush()
    assert len(tasks) == 2  # 5 keys in batches of 3
    assert all(s.phase is Phase.IN_FLIGHT for s in lookup.states.values())
    await asyncio.gather(*tasks)
    assert sorted(map(len, backend.calls)) == [2, 3]
    assert [lookup.lookup("r0", k) for k in keys] == [*[Verdict.HIT] * 2, *[Verdict.MISS] * 3]


async def test_finished_requests_free_resolved_states() -> None:
    a, b = prefix_keys(2)
    backend = GatedBackend(existing=[a])
    backend.release.set()
    lookup = AsyncLookup(backend)
    lookup.lookup("A", a)
    lookup.lookup("B", a)
    lookup.lookup("B", b)
    await asyncio.gather(*lookup.flush())
    lookup.request_finished("A")
    assert set(lookup.states) == {a, b}  # B still holds both
    lookup.request_finished("B")
    assert lookup.states == {}
    assert lookup.counts()["requests"] == 0


async def test_close_cancels_probes_in_flight() -> None:
    (k,) = prefix_keys(1)
    backend = GatedBackend()
    lookup = AsyncLookup(backend)
    lookup.lookup("A", k)
    (task,) = lookup.flush()
    await backend.started.wait()
    await lookup.close()
    assert task.cancelled()


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        AsyncLookup(GatedBackend(), max_batch=0)


class WritingBackend:
    """Answers each key's current verdict (HIT_PENDING while its write is in flight)."""

    def __init__(self, verdicts: dict[Hashable, Verdict]) -> None:
        self.verdicts = verdicts
        self.calls: list[list[Hashable]] = []

    async def __call__(self, keys: list[Hashable]) -> dict[Hashable, Verdict]:
        self.calls.append(list(keys))
        return {k: self.verdicts[k] for k in keys if k in self.verdicts}


async def test_a_write_in_flight_is_pending_and_asked_again_until_it_lands() -> None:
    (k,) = prefix_keys(1)
    backend = WritingBackend({k: Verdict.HIT_PENDING})
    lookup = AsyncLookup(backend)
    lookup.lookup("A", k)
    await asyncio.gather(*lookup.flush())
    assert lookup.lookup("A", k) is Verdict.HIT_PENDING
    (again,) = lookup.flush()  # probed again: the write may have landed since
    assert lookup.lookup("A", k) is Verdict.HIT_PENDING  # not RETRY while re-probed
    await again
    backend.verdicts[k] = Verdict.HIT
    await asyncio.gather(*lookup.flush())
    assert lookup.lookup("A", k) is Verdict.HIT
    assert lookup.flush() == []  # a HIT is not probed again
    assert backend.calls == [[k], [k], [k]]


async def test_a_write_pending_past_the_bound_is_a_miss_and_no_longer_probed() -> None:
    (k,) = prefix_keys(1)
    now = [100.0]
    lookup = AsyncLookup(
        WritingBackend({k: Verdict.HIT_PENDING}), max_pending_s=2.0, clock=lambda: now[0]
    )
    lookup.lookup("A", k)
    await asyncio.gather(*lookup.flush())
    now[0] += 1.9
    await asyncio.gather(*lookup.flush())
    assert lookup.lookup("A", k) is Verdict.HIT_PENDING
    now[0] += 0.1  # pending for 2 s since first seen writing: waited long enough
    assert lookup.lookup("A", k) is Verdict.MISS
    assert lookup.flush() == []
    assert lookup.lookup("B", k) is Verdict.MISS
