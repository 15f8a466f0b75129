"""Which reply streams still have a live gateway behind them: heartbeats, the bound, outages."""

from __future__ import annotations

from services.scheduler.gateway_watch import GatewayWatch
from shared.protocol import Heartbeat
from shared.streams import Streams

STREAMS = Streams("c")
A, B = STREAMS.replies("gw-a"), STREAMS.replies("gw-b")
TIMEOUT = 10.0
GAP = 3.0  # reads answer every second here; a gap longer than this is an outage


def beat(instance: str, service: str = "gateway") -> Heartbeat:
    return Heartbeat(service=service, instance_id=instance, incarnation="i")  # type: ignore[arg-type]


def watch(now: float = 0.0, timeout: float = TIMEOUT) -> GatewayWatch:
    return GatewayWatch(timeout, STREAMS.replies, max_read_gap_s=GAP, now=now)


def answer(w: GatewayWatch, start: float, end: float, beating: tuple[str, ...] = ()) -> float:
    """Heartbeat reads answering every second from `start` to `end`, `beating` gateways
    beating in each; returns `end`."""
    t = start
    while t < end:
        t = min(t + 1.0, end)
        w.bus_answered(t)
        for instance in beating:
            w.beat(beat(instance), t)
    return t


def test_a_gateway_that_stops_beating_is_dead_after_the_bound_and_not_before() -> None:
    w = watch()
    t = answer(w, 0, 5, ("gw-a", "gw-b"))
    assert w.orphaned([A, B], t) == set()
    t = answer(w, t, t + TIMEOUT, ("gw-a",))  # gw-b silent for exactly the bound: alive
    assert w.orphaned([A, B], t) == set()
    t = answer(w, t, t + 0.5, ("gw-a",))
    assert w.orphaned([A, B], t) == {B}


def test_a_claimed_stream_never_heard_of_is_dead_one_bound_after_the_watch_starts() -> None:
    """A restarted scheduler asked about a dead gateway's claimed requests at once."""
    w = watch(now=100.0)
    assert w.orphaned([A], 100.0) == set()
    t = answer(w, 100.0, 100.0 + TIMEOUT)
    assert w.orphaned([A], t) == set()
    t = answer(w, t, t + 1)
    assert w.orphaned([A], t) == {A}


def test_a_new_gateways_requests_before_its_first_beat_is_read_are_not_orphaned() -> None:
    """The watch has run for longer than the bound when a gateway that just started publishes
    its first requests; its first beat is read after them. Its silence counts from when the
    watch first saw its stream, not from the watch's start."""
    w = watch()
    t = answer(w, 0, 5 * TIMEOUT, ("gw-a",))
    assert w.orphaned([A, B], t) == set()  # gw-b's first request, no beat of it read yet
    t = answer(w, t, t + TIMEOUT - 1, ("gw-a",))
    assert w.orphaned([A, B], t) == set()
    w.beat(beat("gw-b"), t)  # its first beat, read late
    t = answer(w, t, t + TIMEOUT, ("gw-a", "gw-b"))
    assert w.orphaned([A, B], t) == set()


def test_a_new_gateway_that_never_beats_is_dead_one_bound_after_its_first_request() -> None:
    w = watch()
    t = answer(w, 0, 5 * TIMEOUT, ("gw-a",))
    assert w.orphaned([B], t) == set()
    first = t
    t = answer(w, t, first + TIMEOUT, ("gw-a",))
    assert w.orphaned([B], t) == set()
    t = answer(w, t, t + 1, ("gw-a",))
    assert w.orphaned([B], t) == {B}


def test_beats_of_other_services_do_not_keep_a_reply_stream_alive() -> None:
    w = watch()
    t = answer(w, 0, 5)
    assert w.orphaned([A], t) == set()
    t = answer(w, t, t + TIMEOUT + 1)
    w.beat(beat("gw-a", service="scheduler"), t)
    assert w.orphaned([A], t) == {A}


def test_an_outage_longer_than_the_bound_kills_no_gateway() -> None:
    """No beat can arrive while Redis is away: the silence starts again when reads answer."""
    w = watch()
    t = answer(w, 0, 5, ("gw-a",))
    outage_end = t + 4 * TIMEOUT  # no read answered meanwhile
    assert w.orphaned([A], outage_end) == set()  # nor while the bus is silent
    w.bus_answered(outage_end)
    assert w.orphaned([A], outage_end) == set()
    t = answer(w, outage_end, outage_end + TIMEOUT)
    assert w.orphaned([A], t) == set()
    t = answer(w, t, t + 1)  # silent for the bound since the outage ended: dead
    assert w.orphaned([A], t) == {A}


def test_a_zero_timeout_never_declares_anything_dead() -> None:
    w = watch(timeout=0.0)
    t = answer(w, 0, 100)
    assert w.orphaned([A, B], t) == set()


def test_a_forgotten_dead_gateway_is_dead_again_one_bound_after_it_is_asked_about() -> None:
    """Forgetting bounds the watch's memory: a long-dead gateway's stream asked about again
    (a redelivered request of it) gets one bound of grace, as a new gateway's would, then is
    dead again."""
    w = watch()
    t = answer(w, 0, 5, ("gw-a",))
    t = answer(w, t, t + 5 * TIMEOUT)
    assert w.orphaned([A], t) == {A}
    w.forget_older_than(t, 2 * TIMEOUT)
    assert w.orphaned([A], t) == set()
    t = answer(w, t, t + TIMEOUT + 1)
    assert w.orphaned([A], t) == {A}


def test_forgetting_drops_streams_asked_about_long_ago_and_never_beaten() -> None:
    w = watch()
    t = answer(w, 0, 5)
    w.orphaned([A], t)
    t = answer(w, t, t + 3 * TIMEOUT)
    assert w.orphaned([A], t) == {A}
    w.forget_older_than(t, 2 * TIMEOUT)
    assert w._first_asked == {}
