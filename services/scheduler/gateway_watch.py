"""Which reply streams still have a live gateway behind them (pure: times are passed in).

Every gateway publishes a Heartbeat each `heartbeat_interval_s` with its instance id, and its
reply stream is `Streams.replies(instance_id)`. A request whose reply stream has heard no beat
for `timeout_s` belongs to a dead gateway: nobody will read its tokens, so the scheduler aborts
it and frees its KV instead of computing it to the end.

Silence counts only while the bus answers. The watch is told each time a heartbeat read
returns; a gap between two answers longer than `max_read_gap_s` was a Redis outage (or this
scheduler stalled), when no beat could arrive: every gateway's silence then starts again from
the end of the gap, so an outage of any length never makes the gateways look dead. A stream
never heard from is judged from the first time the watch was asked about it (its first request
held here), or from the watch's (re)start if later: a gateway that has just started may publish
its first requests before its first beat is read, and must not be taken for dead then; a
restarted scheduler that claims a dead gateway's requests aborts them one `timeout_s` later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shared.protocol import Heartbeat


class GatewayWatch:
    def __init__(
        self,
        timeout_s: float,
        reply_stream_of: Callable[[str], str],
        *,
        max_read_gap_s: float,
        now: float,
    ) -> None:
        """`timeout_s` 0 never declares a gateway dead. `reply_stream_of(instance_id)` names a
        gateway's reply stream."""
        self.timeout_s = timeout_s
        self.reply_stream_of = reply_stream_of
        self.max_read_gap_s = max_read_gap_s
        self._seen: dict[str, float] = {}  # reply stream -> its gateway's last beat
        self._first_asked: dict[str, float] = {}  # never-beaten reply stream -> first asked
        self._origin = now  # silence before this is not counted
        self._answered_at = now

    def beat(self, heartbeat: Heartbeat, now: float) -> None:
        if heartbeat.service == "gateway":
            stream = self.reply_stream_of(heartbeat.instance_id)
            self._seen[stream] = now
            self._first_asked.pop(stream, None)

    def bus_answered(self, now: float) -> None:
        """A heartbeat read returned (with beats or without)."""
        if now - self._answered_at > self.max_read_gap_s:
            self._origin = now
        self._answered_at = now

    def silent_for(self, reply_stream: str, now: float) -> float:
        since = self._seen.get(reply_stream, self._first_asked.get(reply_stream, now))
        return now - max(since, self._origin)

    def orphaned(self, reply_streams: Iterable[str], now: float) -> set[str]:
        """The streams among `reply_streams` whose gateway is dead; none while the bus is not
        answering (the gap is counted when it ends)."""
        if self.timeout_s <= 0 or now - self._answered_at > self.max_read_gap_s:
            return set()
        streams = set(reply_streams)
        for stream in streams - self._seen.keys():
            self._first_asked.setdefault(stream, now)
        return {s for s in streams if self.silent_for(s, now) > self.timeout_s}

    def forget_older_than(self, now: float, age_s: float) -> None:
        """Drop gateways silent for `age_s` (bounded memory across many gateway restarts)."""
        self._seen = {s: t for s, t in self._seen.items() if now - t <= age_s}
        self._first_asked = {s: t for s, t in self._first_asked.items() if now - t <= age_s}
