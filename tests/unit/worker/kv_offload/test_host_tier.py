"""The host tier: bounded by bytes, least recently used out first."""

from __future__ import annotations

import random

from services.worker.kv_offload.host_tier import HostTier


def test_bytes_never_exceed_the_capacity() -> None:
    tier = HostTier(1000)
    rng = random.Random(0)
    for i in range(500):
        tier.put(f"k{rng.randrange(60)}", bytes(rng.randrange(1, 400)))
        assert tier.nbytes == sum(len(tier._values[k]) for k in tier._values) <= 1000
        if i % 3 == 0:
            tier.get(f"k{rng.randrange(60)}")


def test_least_recently_used_goes_first_and_reads_refresh() -> None:
    tier = HostTier(300)
    for key in ("a", "b", "c"):
        tier.put(key, bytes(100))
    assert tier.get("a") == bytes(100)  # now b is the oldest
    tier.put("d", bytes(100))
    assert "b" not in tier and {"a", "c", "d"} == set(tier._values)
    tier.put("e", bytes(150))  # needs two evictions: c, then a
    assert set(tier._values) == {"d", "e"} and tier.nbytes == 250
    assert tier.get("b") is None and (tier.hits, tier.misses) == (1, 1)


def test_replacing_and_oversized_values() -> None:
    tier = HostTier(100)
    tier.put("a", bytes(60))
    tier.put("a", bytes(30))
    assert tier.nbytes == 30
    assert not tier.put("big", bytes(101))
    assert "big" not in tier and tier.nbytes == 30
    assert not tier.put("a", bytes(200))  # an oversized refresh drops the old value too
    assert len(tier) == 0 and tier.nbytes == 0
    assert not HostTier(0).put("x", b"1")
