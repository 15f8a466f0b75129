"""The two bounds of a request in flight: total time and time without progress."""

from __future__ import annotations

from services.gateway.stream.request_deadline import RequestDeadline


def test_the_first_token_is_bounded_by_the_progress_timeout() -> None:
    deadline = RequestDeadline(now=100.0, total_s=600.0, progress_s=30.0)
    assert deadline.remaining_s(100.0) == 30.0  # queueing and prefill count
    assert deadline.passed(129.9) is None
    assert deadline.passed(130.0) == "progress"
    assert deadline.remaining_s(131.0) == 0.0


def test_each_delta_restarts_the_progress_bound() -> None:
    deadline = RequestDeadline(now=0.0, total_s=600.0, progress_s=30.0)
    for now in (20.0, 45.0, 70.0):  # gaps under 30 s: never passes, though 70 > 30
        assert deadline.passed(now) is None
        deadline.progressed(now)
    assert deadline.remaining_s(80.0) == 20.0
    assert deadline.passed(100.0) == "progress"


def test_the_total_bound_holds_however_well_it_progresses() -> None:
    deadline = RequestDeadline(now=0.0, total_s=50.0, progress_s=30.0)
    deadline.progressed(40.0)  # progress bound now 70, total stays 50
    assert deadline.remaining_s(40.0) == 10.0
    assert deadline.passed(50.0) == "total"
    assert deadline.passed(80.0) == "total"  # both passed: the whole time ran out


def test_zero_disables_the_progress_bound() -> None:
    deadline = RequestDeadline(now=0.0, total_s=600.0, progress_s=0.0)
    deadline.progressed(10.0)
    assert deadline.remaining_s(0.0) == 600.0
    assert deadline.passed(599.0) is None
    assert deadline.passed(600.0) == "total"
