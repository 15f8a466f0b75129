"""The supervisor restarts real processes that die, with Docker's backoff, and reports it."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from infra.supervisor import (
    INITIAL_DELAY_S,
    MAX_DELAY_S,
    STABLE_AFTER_S,
    RestartBackoff,
    Supervised,
    Supervisor,
)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_backoff_doubles_to_a_minute_and_resets_after_a_stable_run() -> None:
    backoff = RestartBackoff()
    delays = [backoff.next_delay(ran_for_s=0.5) for _ in range(12)]
    assert delays[:4] == [INITIAL_DELAY_S, 0.2, 0.4, 0.8]
    assert delays[-1] == MAX_DELAY_S and max(delays) == MAX_DELAY_S
    assert backoff.next_delay(ran_for_s=STABLE_AFTER_S) == INITIAL_DELAY_S


class Clock:
    """The supervisor's clock, moved by the test (the processes are real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def supervisor() -> tuple[Supervisor, Clock, list[str]]:
    clock, said = Clock(), []
    return Supervisor(said.append, clock=clock), clock, said


def test_a_killed_process_is_restarted_after_its_delay_and_counted(
    supervisor: tuple[Supervisor, Clock, list[str]], tmp_path: Path
) -> None:
    sup, clock, said = supervisor
    log = (tmp_path / "svc.log").open("ab")
    process = Supervised("svc", SLEEPER, tmp_path, log=log)
    sup.start(process)
    try:
        assert sup.poll() == [] and process.running
        first = process.proc
        assert first is not None
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert sup.poll() == []  # noticed, restart scheduled in 0.1 s
        assert said == ["svc exited with status -9; restarting in 0.1 s (restart 1)"]
        assert not process.running
        assert sup.poll() == []  # not due yet: the clock did not move
        clock.now += INITIAL_DELAY_S
        assert sup.poll() == [process]
        assert process.running and process.proc is not first
        assert process.restarts == 1 and sup.restarts == {"svc": 1}
        assert said[-1] == f"svc restarted (pid {process.proc.pid}, restart 1)"

        # It dies again at once: the delay doubles.
        process.proc.send_signal(signal.SIGKILL)
        process.proc.wait()
        sup.poll()
        assert said[-1].endswith("restarting in 0.2 s (restart 2)")
    finally:
        if process.proc is not None and process.running:
            process.proc.kill()
            process.proc.wait()
        log.close()
    text = (tmp_path / "svc.log").read_text()
    assert "launcher: svc exited with status -9; restarting in 0.1 s (restart 1)" in text
    assert "launcher: svc restarted (pid" in text


def test_a_process_that_ran_long_enough_restarts_at_the_first_delay_again(
    supervisor: tuple[Supervisor, Clock, list[str]], tmp_path: Path
) -> None:
    sup, clock, said = supervisor
    process = Supervised("svc", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path)
    process.backoff.delay_s = 8.0  # as after several quick crashes
    sup.start(process)
    assert process.proc is not None
    process.proc.wait()
    clock.now += STABLE_AFTER_S
    sup.poll()
    assert said == ["svc exited with status 3; restarting in 0.1 s (restart 1)"]
