"""The kvstore's write deadline covers the writes, not the step before them: it runs from the
`store` call and restarts when the scheduler says the step ended (`writes_started`)."""

from __future__ import annotations

from services.kvstore.chunk_table import ChunkStatus
from services.kvstore.lru import LRUPolicy
from services.kvstore.offload_tier import ChunkOffer, OffloadTier
from tests.unit.kvstore.prefix import prefix_chunks

NBYTES = 100
DEADLINE = 10.0


def test_the_deadline_restarts_when_the_writes_start() -> None:
    chunks = prefix_chunks(3)
    keys = [k for k, _ in chunks]
    tier = OffloadTier(LRUPolicy(10 * NBYTES))
    plan = tier.store("r1", [ChunkOffer(k, end, NBYTES) for k, end in chunks], now=0.0)
    assert plan.write == keys
    assert tier.stored(keys[:1], ok=True) == keys[:1]  # one write already reported
    # A long prefill: its step ends at t=50; only the chunks still being written restart.
    assert tier.writes_started(keys, now=50.0) == keys[1:]
    assert tier.expire_writes(now=50.0 + DEADLINE - 1, max_age=DEADLINE) == []
    assert tier.expire_writes(now=50.0 + DEADLINE + 1, max_age=DEADLINE) == keys[1:]
    assert tier.lookup(keys) == [ChunkStatus.READY, None, None]
    assert tier.writes_started(keys, now=70.0) == []  # expired or done: nothing to restart


def test_without_the_start_signal_the_store_call_starts_the_deadline() -> None:
    ((key, end),) = prefix_chunks(1)
    tier = OffloadTier(LRUPolicy(10 * NBYTES))
    tier.store("r1", [ChunkOffer(key, end, NBYTES)], now=0.0)
    assert tier.expire_writes(now=DEADLINE + 1, max_age=DEADLINE) == [key]


def test_a_write_whose_step_still_runs_gets_the_long_deadline() -> None:
    """A 1,500-token prefill outlasting the write deadline: its chunks wait for the step (long
    deadline), then have the short one for the writes themselves."""
    ((key, end),) = prefix_chunks(1)
    tier = OffloadTier(LRUPolicy(10 * NBYTES))
    tier.store("r1", [ChunkOffer(key, end, NBYTES)], now=0.0)
    assert tier.expire_writes(now=5 * DEADLINE, max_age=DEADLINE, max_unstarted_age=100.0) == []
    assert tier.writes_started([key], now=60.0) == [key]
    assert (
        tier.expire_writes(now=60.0 + DEADLINE - 1, max_age=DEADLINE, max_unstarted_age=100.0) == []
    )
    assert tier.expire_writes(
        now=60.0 + DEADLINE + 1, max_age=DEADLINE, max_unstarted_age=999.0
    ) == [key]
