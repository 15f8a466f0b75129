"""The gateway's view of the worker groups: every scheduler that beats on the heartbeat stream,
by instance id, with its group, model, role, readiness and last beat.

A scheduler reports ready only while its worker is alive (its own `/ready`), so one alive, ready
scheduler is one worker group able to serve. From that the view answers whether a request for a
model can be served now, and if not, why. Pure: fed Heartbeat messages, asked with an explicit
`now` on the wall clock the beats' `time` is written with (hosts are assumed NTP-synced, as any
comparison of beat times across hosts does). Each beat carries its group's load, which the
router balances by.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import Heartbeat
from shared.protocol.health import GroupLoad, GroupRole

ALIVE_INTERVALS = 3
"""A scheduler is alive while its last beat is younger than this many of its beat intervals:
one late beat is jitter, three missed ones a dead (or partitioned) process."""
LAPSE_GRACE_INTERVALS = 1
"""A group that stopped beating within this many intervals past its alive window has lapsed,
not gone: a request is held that long for its next beat before the 503 (MeshView.grace_s)."""
FORGET_INTERVALS = 100
"""Records this stale are dropped, so instances that left for good do not pile up."""


@dataclass(frozen=True)
class SchedulerRecord:
    """The latest beat of one scheduler instance. A restarted scheduler keeps its instance id
    and brings a new incarnation: its first beat replaces the old process's record."""

    instance_id: str
    incarnation: str
    group: str
    model: str
    role: GroupRole
    ready: bool
    last_beat: float
    interval_s: float
    load: GroupLoad | None = None  # None: a scheduler older than load reports
    ready_since: float | None = None  # the first beat of its current ready run

    def alive(self, now: float) -> bool:
        return now - self.last_beat < ALIVE_INTERVALS * self.interval_s

    def settled(self, now: float) -> bool:
        """Ready for at least one beat interval. While a group is not ready, the other groups'
        schedulers read its stream (services/scheduler/peer_groups.py); its first ready beat
        reaches them when it reaches this gateway, so a request routed to it at once could be
        taken by a peer that has not yet seen that beat. One interval later they have."""
        return self.ready_since is not None and now - self.ready_since >= self.interval_s

    def serves(self, model: str) -> bool:
        # A beat without a model comes from a scheduler older than the field; a mesh serves one
        # model, so it is taken to serve the gateway's rather than to serve nothing.
        return not self.model or self.model == model


@dataclass(frozen=True)
class Serving:
    """Whether a request for `model` can be served now: `ok`, the worker groups that would take
    it, and `reason` ("ok", or what is missing, for /ready and the 503)."""

    ok: bool
    reason: str
    groups: tuple[str, ...] = ()


class MeshView:
    def __init__(self, default_interval_s: float) -> None:
        """`default_interval_s`: the beat interval assumed for beats that do not state theirs
        (older processes); the gateway's own."""
        self.default_interval_s = default_interval_s
        self._schedulers: dict[str, SchedulerRecord] = {}

    def observe(self, beat: Heartbeat) -> bool:
        """Take one beat; True when it was taken. Only schedulers' beats count (a
        worker's readiness reaches the gateway through its scheduler's), and a beat older than
        the one held for its instance is ignored."""
        if beat.service != "scheduler":
            return False
        held = self._schedulers.get(beat.instance_id)
        if held is not None and beat.time < held.last_beat:
            return False
        ready_since = None
        if beat.ready:
            same_run = held is not None and held.incarnation == beat.incarnation
            ready_since = held.ready_since if same_run and held.ready_since else beat.time
        record = SchedulerRecord(
            instance_id=beat.instance_id,
            incarnation=beat.incarnation,
            group=beat.group,
            model=beat.model,
            role=beat.role,
            ready=beat.ready,
            last_beat=beat.time,
            interval_s=beat.interval_s or self.default_interval_s,
            load=beat.load,
            ready_since=ready_since,
        )
        self._schedulers[beat.instance_id] = record
        self._forget(beat.time)
        return True

    def schedulers(self, now: float) -> list[SchedulerRecord]:
        """The alive schedulers, by instance id."""
        return sorted(
            (r for r in self._schedulers.values() if r.alive(now)), key=lambda r: r.instance_id
        )

    def groups(self) -> set[str]:
        """Every group a record is held for, alive or not: a group leaves only when its records
        are forgotten (FORGET_INTERVALS), not when a beat is late (its cache is still there)."""
        return {r.group for r in self._schedulers.values()}

    def routable(self, model: str, now: float) -> list[SchedulerRecord]:
        """The alive schedulers serving `model` whole, ready for a beat interval (`settled`),
        that report their load: the groups a gateway routes requests to
        (services/gateway/route). Prefill/decode groups and older schedulers read the shared
        requests stream instead, as every ready group does while none is settled."""
        return [
            r
            for r in self.schedulers(now)
            if r.serves(model) and r.settled(now) and r.role in ("", "both") and r.load is not None
        ]

    def serving(self, model: str, now: float) -> Serving:
        """A request for `model` is served by a ready group that serves requests whole, or by a
        ready prefill group together with a ready decode group (prefill/decode disaggregation:
        a decode group alone reads only handoffs, a prefill group alone never finishes one)."""
        alive = [r for r in self.schedulers(now) if r.serves(model)]
        ready = [r for r in alive if r.ready]
        whole = [r for r in ready if r.role in ("", "both")]
        prefill = [r for r in ready if r.role == "prefill"]
        decode = [r for r in ready if r.role == "decode"]
        takers = whole + (prefill if decode else [])
        if takers:
            return Serving(True, "ok", tuple(sorted({r.group for r in takers})))
        count = f"{len(alive)} scheduler{'' if len(alive) == 1 else 's'} alive"
        if prefill:
            detail = f"{count}: prefill groups ready, no decode group ready"
        elif decode:
            detail = f"{count}: decode groups ready, no group taking requests"
        elif alive:
            detail = f"{count}, none ready"
        else:
            detail = count
        return Serving(False, f"no ready worker group for model {model!r} ({detail})")

    def grace_s(self, model: str, now: float) -> float:
        """How long a request for `model` that cannot be served now should wait for the next
        beats before its 503: one beat interval when a ready scheduler serving `model` fell out
        of its alive window less than LAPSE_GRACE_INTERVALS ago, else 0.

        Such a lapse is more often a late reading than a dead process: a gateway whose event
        loop was held (a long request's work) answers its next request before its beat reader
        has read the beats that came meanwhile, and a loaded host can delay a beat past the
        window. A scheduler that did die is refused one interval later than before; a mesh
        with no scheduler at all is refused at once."""
        waits = [
            r.interval_s
            for r in self._schedulers.values()
            if r.serves(model)
            and r.ready
            and not r.alive(now)
            and now - r.last_beat < (ALIVE_INTERVALS + LAPSE_GRACE_INTERVALS) * r.interval_s
        ]
        return max(waits, default=0.0)

    def _forget(self, now: float) -> None:
        stale = [
            key
            for key, r in self._schedulers.items()
            if now - r.last_beat > FORGET_INTERVALS * r.interval_s
        ]
        for key in stale:
            del self._schedulers[key]
