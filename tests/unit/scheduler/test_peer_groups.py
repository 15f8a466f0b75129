"""Which other groups' request streams a scheduler looks after (peer_groups.py)."""

from __future__ import annotations

from services.scheduler.intake import CLAIM_REFRESH_S, claim_refresh_s
from services.scheduler.peer_groups import PeerGroups
from shared.protocol import Heartbeat


def beat(group: str, t: float, *, ready=True, role="both", service="scheduler") -> Heartbeat:
    return Heartbeat(
        service=service,
        instance_id=f"{service}-{group}",
        incarnation="x",
        group=group,
        ready=ready,
        time=t,
        role=role,
        interval_s=1.0,
    )


def test_silent_or_unready_peers_are_adopted_live_ones_are_not() -> None:
    peers = PeerGroups("0", 1.0)
    for b in (beat("0", 10), beat("1", 10), beat("2", 10, ready=False), beat("3", 5)):
        peers.beat(b)
    assert peers.known(10.5) == ["1", "2", "3"]  # never our own
    assert peers.not_serving(10.5) == ["2", "3"]  # 3 is silent past three intervals
    peers.beat(beat("3", 10.4))
    assert peers.not_serving(10.5) == ["2"]
    assert peers.not_serving(14.0) == ["1", "2", "3"]


def test_only_whole_schedulers_count() -> None:
    peers = PeerGroups("0", 1.0)
    peers.beat(beat("1", 1, role="prefill"))
    peers.beat(beat("2", 1, service="worker"))
    peers.beat(beat("3", 1, role=""))  # an older scheduler: serves whole
    assert peers.known(1.0) == ["3"]


def test_an_older_beat_does_not_undo_a_newer_one() -> None:
    peers = PeerGroups("0", 1.0)
    peers.beat(beat("1", 10))
    peers.beat(beat("1", 9, ready=False))
    assert peers.not_serving(10.1) == []


def test_a_live_schedulers_entries_are_refreshed_well_within_the_claim_idle_time() -> None:
    # A refresh every CLAIM_REFRESH_S with claim_idle_ms = 2000 (tests/e2e) let an entry held
    # for a 2 s generation reach the idle time at which a peer claims it from a live group.
    assert claim_refresh_s(15_000) == CLAIM_REFRESH_S
    for idle_ms in (400, 2_000, 3_000, 8_000):
        assert claim_refresh_s(idle_ms) * 1000 <= idle_ms / 4
