"""MESHLLM_API_PROCESSES > 1: several gateway processes serve the API on one port, as vLLM's
`--api-server-count` does.

One gateway process admits requests on one event loop: under a burst (a benchmark's 64 at
once) the last request waits for the admission work of all the others, and the scheduler's
first steps run with part of the batch. With N processes the burst is admitted N at a time.

The process that `python -m services.gateway` starts binds the port, listens, and spawns the
API processes with that socket; the kernel hands each new connection to one of them (whichever
accepts first, as under uvicorn's and gunicorn's workers). Each is a whole gateway, as a
replica would be: its own instance id (`<instance_id>-api<k>`, so its own reply stream and
consumer names), planning processes, mesh view and router, started in parallel.

The parent only supervises:
- SIGTERM/SIGINT go to every API process, each drains (as a lone gateway does) and the parent
  exits 0 once all have exited 0;
- an API process that exits on its own (crashed, killed) takes the others down and the parent
  exits 1, so whatever supervises the gateway (compose, Swarm, Kubernetes, infra/launcher.py)
  restarts it whole, as it would a lone gateway's crash;
- a drain (the admin action or SIGUSR2) reaching one API process is relayed to all of them
  (SIGUSR2), since they answer on the same port;
- /ready is 200 only once every API process has started (flags in shared memory): before
  that, a connection the kernel gives to one still loading would get a 503.

Metrics: the parent sets PROMETHEUS_MULTIPROC_DIR (a fresh directory) before spawning, so
/metrics from any of them is every process's counters and histograms summed
(shared/metrics.py); gauges combine by their `multiprocess_mode` (service_ready: the least of
the live ones). /admin/state and /ready are the answering process's own (`api_process` in the
state says which).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from prometheus_client import multiprocess

from shared.child_process import die_with_parent
from shared.config import GatewaySettings
from shared.logs import configure_logging
from shared.service import bind_socket, run_service

log = logging.getLogger(__name__)

#: Connections the kernel queues for the API processes (while they start, or are all busy).
BACKLOG = 2048
#: How long the parent waits for the API processes after relaying SIGTERM, beyond their drain.
EXIT_GRACE_S = 15.0


@dataclass(frozen=True)
class ApiProcess:
    """An API process's place among its siblings. `started`: one flag per API process in
    memory they share, set once its gateway has started."""

    index: int
    count: int
    parent_pid: int
    started: Any  # multiprocessing.Array("b", count)

    def mark_started(self) -> None:
        self.started[self.index] = 1

    def started_count(self) -> int:
        return sum(self.started[:])

    def drain_siblings(self) -> None:
        """Ask the parent to drain every API process (this one included: a drain is idempotent)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.parent_pid, signal.SIGUSR2)

    def describe(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count, "pid": os.getpid()}


def api_process_main(process: ApiProcess, sock: socket.socket) -> None:
    """An API process: a gateway on the shared socket, dying with the parent."""
    die_with_parent(process.parent_pid)
    # A sibling's drain relayed before this process has its handler (it is still importing)
    # must not kill it (SIGUSR2's default); serve() takes the signal over once it runs.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    from services.gateway.service import GatewayService

    base = GatewaySettings()
    settings = base.model_copy(update={"instance_id": f"{base.instance_id}-api{process.index}"})
    run_service(GatewayService(settings, process), sock=sock)


class ApiProcesses:
    """The parent: start the API processes, relay signals, end with them."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.processes: list[BaseProcess] = []
        self.stopping = False

    def run(self) -> int:
        s = self.settings
        metrics_dir = tempfile.mkdtemp(prefix="meshllm-gateway-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before any child imports metrics
        try:
            sock = bind_socket(s.host, s.port)
        except OSError as exc:
            log.error("%s", exc)
            shutil.rmtree(metrics_dir, ignore_errors=True)
            return 1
        sock.listen(BACKLOG)
        handlers = {sig: signal.signal(sig, self._relay) for sig in self._relayed()}
        try:
            context = mp.get_context("spawn")
            started = context.Array("b", s.api_processes, lock=False)
            for index in range(s.api_processes):
                place = ApiProcess(index, s.api_processes, os.getpid(), started)
                process = context.Process(
                    target=api_process_main, args=(place, sock), name=f"gateway-api-{index}"
                )
                process.start()
                self.processes.append(process)
            log.info(
                "gateway: %d API processes on %s:%s (pids %s)",
                len(self.processes), *sock.getsockname()[:2],
                ", ".join(str(p.pid) for p in self.processes),
            )  # fmt: skip
            return self._supervise()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            sock.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)

    @staticmethod
    def _relayed() -> tuple[signal.Signals, ...]:
        return (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)

    def _relay(self, signum: int, _frame: FrameType | None) -> None:
        if signum != signal.SIGUSR2:
            self.stopping = True
            signum = signal.SIGTERM  # Ctrl-C reaches the children from the terminal as well
        self._signal_all(signum)

    def _signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    def _supervise(self) -> int:
        """Wait for the API processes; the parent's exit status."""
        status = 0
        deadline: float | None = None  # set once stopping: the drain's bound and some grace
        running = {p.sentinel: p for p in self.processes}
        while running:
            if self.stopping and deadline is None:
                deadline = time.monotonic() + self.settings.shutdown_timeout_s + EXIT_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                log.warning("API processes still running past the drain's bound; killing them")
                for process in running.values():
                    process.kill()
                status, deadline = 1, float("inf")
            for sentinel in wait(list(running), timeout=0.5):
                process = running.pop(sentinel)
                process.join()
                with contextlib.suppress(OSError):  # its live gauges leave the sums
                    multiprocess.mark_process_dead(process.pid)
                code = process.exitcode
                if not self.stopping:
                    log.error(
                        "API process %s (pid %s) exited with code %s; stopping the others",
                        process.name, process.pid, code,
                    )  # fmt: skip
                    self.stopping = True
                    self._signal_all(signal.SIGTERM)
                    status = 1
                elif code != 0:
                    status = 1
        return status


def serve_api_processes(settings: GatewaySettings) -> int:
    configure_logging("gateway", settings.instance_id, settings.log_level, settings.log_json)
    return ApiProcesses(settings).run()
