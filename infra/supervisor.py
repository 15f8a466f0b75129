"""Keep the local mesh's processes running, as compose's `restart: unless-stopped` keeps its
containers: a process that exits while no stop was requested is started again.

The delay before a restart follows Docker's restart manager: 100 ms, doubling with every
restart up to a minute, back to 100 ms once the process had stayed up 10 s. So a process killed
once is back at once, and one that crashes at start does not spin. Every exit and restart is
reported (name, exit status, delay, pid) through `say`, written into the process's own log
file when it has one, and counted per process (`restarts`).

`poll()` does one round (notice exits, start what is due) and never blocks: the launcher calls
it from its watch loop, and stops calling it when a stop is requested, so nothing is restarted
while the mesh shuts down.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

INITIAL_DELAY_S = 0.1
MAX_DELAY_S = 60.0
STABLE_AFTER_S = 10.0


@dataclass
class RestartBackoff:
    """The delays between restarts of one process."""

    delay_s: float = INITIAL_DELAY_S

    def next_delay(self, ran_for_s: float) -> float:
        """The delay before restarting a process that ran `ran_for_s` before it exited."""
        if ran_for_s >= STABLE_AFTER_S:
            self.delay_s = INITIAL_DELAY_S
        delay = self.delay_s
        self.delay_s = min(self.delay_s * 2, MAX_DELAY_S)
        return delay


@dataclass
class Supervised:
    """One process of the mesh: how to start it, and its current incarnation."""

    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] | None = None  # None: the launcher's own environment
    port: int | None = None  # its HTTP port (readiness), None for redis-server
    log: IO[bytes] | None = field(default=None, repr=False)  # None: the launcher's stdout
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None  # when a restart is due, while one is pending
    backoff: RestartBackoff = field(default_factory=RestartBackoff)

    def start(self, now: float) -> None:
        # Its own session: a terminal's Ctrl-C reaches only the launcher, which then stops
        # the processes in order.
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT if self.log else None,
            start_new_session=True,
        )
        self.started_at = now

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(
        self,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.say = say
        self.clock = clock
        self.processes: list[Supervised] = []

    def start(self, process: Supervised) -> None:
        process.start(self.clock())
        self.processes.append(process)

    @property
    def restarts(self) -> dict[str, int]:
        return {p.name: p.restarts for p in self.processes}

    def poll(self) -> list[Supervised]:
        """One round: schedule a restart for each process that exited, start those that are
        due. Returns the processes restarted in this round."""
        now = self.clock()
        restarted = []
        for process in self.processes:
            if process.restart_at is None:
                status = process.proc.poll() if process.proc is not None else None
                if status is None:
                    continue
                delay = process.backoff.next_delay(now - process.started_at)
                process.restart_at = now + delay
                self._report(
                    process,
                    f"{process.name} exited with status {status}; restarting in {delay:.1f} s "
                    f"(restart {process.restarts + 1})",
                )
            elif now >= process.restart_at:
                process.restart_at = None
                process.restarts += 1
                process.start(now)
                assert process.proc is not None
                self._report(
                    process,
                    f"{process.name} restarted (pid {process.proc.pid}, restart "
                    f"{process.restarts})",
                )
                restarted.append(process)
        return restarted

    def _report(self, process: Supervised, message: str) -> None:
        self.say(message)
        if process.log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            process.log.write(f"--- {stamp} launcher: {message}\n".encode())
            process.log.flush()
