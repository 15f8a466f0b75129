"""The gateway's mesh view: which schedulers are alive, and whether a request for a model can be
served, from heartbeats alone (no Redis: the view is pure)."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway.mesh.groups import (
    ALIVE_INTERVALS,
    FORGET_INTERVALS,
    LAPSE_GRACE_INTERVALS,
    MeshView,
)
from services.gateway.mesh.heartbeat_reader import history_for, history_start_id
from shared.protocol import Heartbeat

MODEL = "smol"


def beat(t: float, **kw: Any) -> Heartbeat:
    fields: dict[str, Any] = {
        "service": "scheduler",
        "instance_id": "s0",
        "incarnation": "a",
        "group": "0",
        "ready": True,
        "model": MODEL,
        "role": "both",
        "interval_s": 1.0,
    }
    fields.update(kw)
    return Heartbeat(time=t, **fields)


def view(*beats: Heartbeat) -> MeshView:
    v = MeshView(default_interval_s=1.0)
    for b in beats:
        v.observe(b)
    return v


def test_an_alive_ready_scheduler_serves_its_group() -> None:
    serving = view(beat(100.0)).serving(MODEL, 100.5)
    assert serving.ok and serving.reason == "ok" and serving.groups == ("0",)


def test_no_beats_no_group() -> None:
    serving = MeshView(1.0).serving(MODEL, 100.0)
    assert not serving.ok
    assert serving.reason == "no ready worker group for model 'smol' (0 schedulers alive)"


def test_a_beat_expires_after_three_of_its_intervals() -> None:
    v = view(beat(100.0, interval_s=0.5))
    assert v.serving(MODEL, 100.0 + ALIVE_INTERVALS * 0.5 - 0.01).ok
    late = v.serving(MODEL, 100.0 + ALIVE_INTERVALS * 0.5)
    assert not late.ok and "(0 schedulers alive)" in late.reason
    assert v.schedulers(101.5) == []


def test_a_group_late_to_beat_is_not_alive_but_has_not_left() -> None:
    # The router keeps what it knows of the group's cache through a late beat: the group
    # leaves only when its record is forgotten, many intervals later.
    v = view(beat(100.0), beat(100.0, instance_id="s1", group="1"))
    v.observe(beat(100.0 + ALIVE_INTERVALS + 1, instance_id="s1", group="1"))
    assert [r.group for r in v.schedulers(100.0 + ALIVE_INTERVALS + 1)] == ["1"]
    assert v.groups() == {"0", "1"}
    v.observe(beat(100.0 + FORGET_INTERVALS + 1, instance_id="s1", group="1"))
    assert v.groups() == {"1"}


def test_a_group_is_routed_to_one_interval_after_its_first_ready_beat() -> None:
    # Until then the other groups may still be reading its stream as a not-ready group's.
    loads = {"load": {"num_waiting": 0, "num_running": 0, "kv_usage": 0.0, "max_num_seqs": 8}}
    v = view(beat(100.0, ready=False, **loads), beat(101.0, **loads))
    assert v.serving(MODEL, 101.1).ok  # it can serve: a 503 would be wrong
    assert v.routable(MODEL, 101.9) == []
    assert [r.group for r in v.routable(MODEL, 102.0)] == ["0"]
    v.observe(beat(102.0, **loads))
    assert [r.group for r in v.routable(MODEL, 102.1)] == ["0"]  # still the run begun at 101
    v.observe(beat(103.0, incarnation="b", **loads))  # restarted: a new run
    assert v.routable(MODEL, 103.5) == []
    v.observe(beat(104.0, ready=False, incarnation="b", **loads))
    v.observe(beat(105.0, incarnation="b", **loads))
    assert v.routable(MODEL, 105.5) == [] and v.routable(MODEL, 106.0) != []


def test_a_beat_without_an_interval_expires_by_the_gateways_own() -> None:
    v = MeshView(default_interval_s=2.0)
    v.observe(beat(100.0, interval_s=0.0))
    assert v.serving(MODEL, 105.9).ok
    assert not v.serving(MODEL, 106.0).ok


def test_an_alive_scheduler_whose_group_is_not_ready() -> None:
    serving = view(beat(100.0, ready=False)).serving(MODEL, 100.0)
    assert not serving.ok
    assert serving.reason == (
        "no ready worker group for model 'smol' (1 scheduler alive, none ready)"
    )


def test_a_scheduler_of_another_model_does_not_count() -> None:
    v = view(beat(100.0, model="other"))
    assert not v.serving(MODEL, 100.0).ok
    assert "(0 schedulers alive)" in v.serving(MODEL, 100.0).reason
    assert v.serving("other", 100.0).ok


def test_a_beat_from_before_the_model_field_serves_any_model() -> None:
    assert view(beat(100.0, model="", role="")).serving(MODEL, 100.0).ok


def test_other_services_beats_are_ignored() -> None:
    v = view(beat(100.0, service="worker"), beat(100.0, service="gateway", instance_id="g"))
    assert not v.serving(MODEL, 100.0).ok
    assert v.schedulers(100.0) == []


def test_a_restarted_incarnation_replaces_the_old_one() -> None:
    v = view(beat(100.0, incarnation="a", ready=True), beat(101.0, incarnation="b", ready=False))
    (record,) = v.schedulers(101.0)
    assert record.incarnation == "b" and not record.ready
    assert not v.serving(MODEL, 101.0).ok  # the old process's readiness died with it
    v.observe(beat(102.0, incarnation="b", ready=True))
    assert v.serving(MODEL, 102.0).ok


def test_an_older_beat_does_not_overwrite_a_newer_one() -> None:
    v = view(beat(105.0, ready=False))
    assert not v.observe(beat(104.0, ready=True))
    assert not v.serving(MODEL, 105.0).ok


def test_one_ready_group_of_several_is_enough() -> None:
    v = view(
        beat(100.0, instance_id="s0", group="0", ready=False),
        beat(100.0, instance_id="s1", group="gpu", ready=True),
        beat(90.0, instance_id="s2", group="old", ready=True),  # expired
    )
    serving = v.serving(MODEL, 100.0)
    assert serving.ok and serving.groups == ("gpu",)
    assert [r.instance_id for r in v.schedulers(100.0)] == ["s0", "s1"]


@pytest.mark.parametrize(
    ("roles", "ok", "detail"),
    [
        (("prefill",), False, "1 scheduler alive: prefill groups ready, no decode group ready"),
        (("decode",), False, "1 scheduler alive: decode groups ready, no group taking requests"),
        (("prefill", "decode"), True, ""),
        (("decode", "both"), True, ""),
    ],
)
def test_prefill_and_decode_groups_serve_only_together(
    roles: tuple[str, ...], ok: bool, detail: str
) -> None:
    v = view(*(beat(100.0, instance_id=r, group=r[0], role=r) for r in roles))
    serving = v.serving(MODEL, 100.0)
    assert serving.ok is ok
    if ok:
        assert serving.groups == tuple(sorted(r[0] for r in roles if r != "decode"))
    else:
        assert serving.reason == f"no ready worker group for model 'smol' ({detail})"


def test_a_ready_group_just_out_of_its_alive_window_gets_one_interval_of_grace() -> None:
    v = view(beat(100.0, interval_s=0.5))
    window = ALIVE_INTERVALS * 0.5
    assert v.grace_s(MODEL, 100.0 + window - 0.01) == 0.0  # still alive: nothing to wait for
    assert v.grace_s(MODEL, 100.0 + window) == 0.5
    assert v.grace_s(MODEL, 100.0 + window + LAPSE_GRACE_INTERVALS * 0.5 - 0.01) == 0.5
    assert v.grace_s(MODEL, 100.0 + window + LAPSE_GRACE_INTERVALS * 0.5) == 0.0  # gone


@pytest.mark.parametrize(
    "lapsed",
    [
        beat(100.0, ready=False),  # it was not serving before it stopped beating
        beat(100.0, model="other"),  # it serves another model
    ],
)
def test_only_a_lapsed_scheduler_that_served_the_model_gets_grace(lapsed: Heartbeat) -> None:
    assert view(lapsed).grace_s(MODEL, 100.0 + ALIVE_INTERVALS + 0.1) == 0.0
    assert MeshView(1.0).grace_s(MODEL, 100.0) == 0.0  # no scheduler ever: refused at once


def test_the_reader_replays_recent_history() -> None:
    assert history_start_id(1000.25, 3.0) == "997250-0"
    assert history_start_id(1.0, 3.0) == "0-0"
    assert history_for(0.2) == 30.0  # at least MIN_HISTORY_S
    assert history_for(20.0) == ALIVE_INTERVALS * 20.0
