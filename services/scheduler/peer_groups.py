"""The other worker groups, as this scheduler's intake sees them on the heartbeat stream (pure:
times are passed in).

Gateways route requests to one group's own stream (Streams.group_requests). A group that cannot
run them must not strand them, so live groups look after the streams of the others:
- every known group's stream is swept for entries idle past `claim_idle_ms` (a dead scheduler's,
  or those a scheduler released when its worker died): a live scheduler keeps its own entries'
  idle time fresh, so only abandoned ones are taken;
- the stream of a group that is not serving (its scheduler silent for ALIVE_INTERVALS beats,
  or beating "not ready": its worker is gone) is also read for new entries, those routed to it
  before the gateways learnt it stopped.
Only schedulers that serve requests whole take part (prefill/decode groups are never routed).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Heartbeat

ALIVE_INTERVALS = 3  # as the gateway's mesh view: three missed beats are a dead scheduler
FORGET_S = 3600.0
"""A group silent this long is forgotten: its stream has long been swept empty."""


@dataclass
class _Peer:
    ready: bool
    last_beat: float
    interval_s: float


class PeerGroups:
    def __init__(self, own_group: str, default_interval_s: float) -> None:
        self.own_group = own_group
        self.default_interval_s = default_interval_s
        self._peers: dict[str, _Peer] = {}

    def beat(self, beat: Heartbeat) -> None:
        if beat.service != "scheduler" or beat.role not in ("", "both"):
            return
        if beat.group == self.own_group:
            return
        held = self._peers.get(beat.group)
        if held is not None and beat.time < held.last_beat:
            return
        interval = beat.interval_s or self.default_interval_s
        self._peers[beat.group] = _Peer(beat.ready, beat.time, interval)

    def known(self, now: float) -> list[str]:
        """Every group heard from recently enough to still have entries, by name."""
        self._forget(now)
        return sorted(self._peers)

    def not_serving(self, now: float) -> list[str]:
        """The groups whose new entries this scheduler should read: silent or not ready."""
        return sorted(
            group
            for group, peer in self._peers.items()
            if not peer.ready or now - peer.last_beat >= ALIVE_INTERVALS * peer.interval_s
        )

    def _forget(self, now: float) -> None:
        for group in [g for g, p in self._peers.items() if now - p.last_beat > FORGET_S]:
            del self._peers[group]
