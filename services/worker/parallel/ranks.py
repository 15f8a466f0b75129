"""The ranks of a tensor-parallel worker group as processes: the worker process is rank 0 and
starts ranks 1..N-1 itself (spawned children, one GPU each on CUDA).

Why the worker spawns them, not the launcher or compose: the group is then one supervised
unit. A follower that dies makes rank 0 exit (`watch`), a rank 0 that dies closes the
followers' command pipes and kills them (PR_SET_PDEATHSIG), and whatever supervises the worker
(compose's restart policy, infra/launcher.py, Kubernetes) restarts the whole group with a new
incarnation, so its scheduler recomputes the requests as after any worker restart.

How steps reach the followers: only rank 0 talks to the bus. It sends each runner call it is
about to make (`launch`/`execute` with the StepPlan, `finish`, `reset`, and `kv_load`: the
blocks of KV offload loads it is about to write, services/worker/kv_offload) down a pipe to every
follower, which makes the same call on its own runner; the forward's collectives then meet in
the same order on every rank. A pipe, not a torch.distributed broadcast: a follower waits on
it without a timeout while the group is idle (a gloo/NCCL broadcast would time out, or need
heartbeats), sees EOF when rank 0 is gone, and a plan (a few KB) costs far less to send than
a Redis round trip (bench/RESULTS.md). Having every rank read the steps stream instead would
put N Redis readers on one stream and make each rank repeat rank 0's incarnation and duplicate
filtering.

The followers sample too, from the same gathered logits with the same seeded counter RNG, so
their batches stay identical to rank 0's without the tokens being sent back (tested:
tests/unit/worker/parallel); so do their speculative drafts, each rank running the whole
drafter on the same inputs (services/worker/spec/__init__.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from services.worker.cpu_threads import worker_threads
from services.worker.parallel.group import TensorParallel, join_group, leave_group
from shared.child_process import die_with_parent
from shared.config import WorkerSettings
from shared.logs import configure_logging
from shared.model.source import ModelSource

log = logging.getLogger(__name__)


def free_init_method() -> str:
    """A rendezvous address for the group on this host (the ranks are one host's processes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


class RankDied(RuntimeError):
    """A follower rank exited: the group cannot compute any more and must restart."""


@dataclass
class Follower:
    rank: int
    process: Any  # a spawned multiprocessing Process
    pipe: Connection


class FollowerRanks:
    """Rank 0's handle on ranks 1..N-1: start them, mirror runner calls, notice a death."""

    def __init__(self, followers: list[Follower]) -> None:
        self.followers = followers
        # Calls come from the step thread and the event loop (reset); one at a time on the
        # pipes, so every follower sees them in rank 0's order.
        self._lock = threading.Lock()

    @classmethod
    def start(
        cls, settings: WorkerSettings, source: ModelSource, incarnation: str, init_method: str
    ) -> FollowerRanks:
        context = mp.get_context("spawn")
        followers = []
        for rank in range(1, settings.tp):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=follower_main,
                args=(rank, settings, source, incarnation, init_method, theirs),
                name=f"worker-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            followers.append(Follower(rank, process, ours))
        return cls(followers)

    def send(self, op: str, arg: Any = None) -> None:
        """Have every follower make runner call `op(arg)` (before rank 0 makes it)."""
        with self._lock:
            for follower in self.followers:
                try:
                    follower.pipe.send((op, arg))
                except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
                    raise RankDied(f"rank {follower.rank} is gone: {exc}") from exc

    def dead(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of every follower that is no longer running. By the process's
        sentinel (a pipe the child's exit closes), not is_alive(): once anything else in this
        process has reaped the child, is_alive() says True for good (CPython #92881); the exit
        code is then unknown (None)."""
        exited = set(wait([f.process.sentinel for f in self.followers], timeout=0))
        return [
            (f.rank, f.process.exitcode) for f in self.followers if f.process.sentinel in exited
        ]

    async def watch(self, stopping: asyncio.Event, interval_s: float = 0.5) -> None:
        """Return when stopping; raise RankDied as soon as a follower exits."""
        while not stopping.is_set():
            if dead := self.dead():
                raise RankDied(f"worker ranks exited (rank, code): {dead}; the group restarts")
            await asyncio.sleep(interval_s)

    def pids(self) -> dict[int, int]:
        return {f.rank: f.process.pid for f in self.followers}

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the followers to stop, then make sure they have."""
        for follower in self.followers:
            with contextlib.suppress(OSError):
                follower.pipe.send(("stop", None))
            follower.pipe.close()
        for follower in self.followers:
            follower.process.join(timeout_s)
            if follower.process.is_alive():
                follower.process.kill()
                follower.process.join(timeout_s)


def follower_main(
    rank: int,
    settings: WorkerSettings,
    source: ModelSource,
    incarnation: str,
    init_method: str,
    pipe: Connection,
) -> None:
    """A follower rank's process: join the group, build the same runner, mirror rank 0."""
    die_with_parent()  # the kernel kills it when rank 0 dies, even inside a collective
    configure_logging(
        f"worker-rank{rank}", settings.instance_id, settings.log_level, settings.log_json
    )
    from services.worker.runner.bootstrap import build_runner, pick_device

    device = pick_device(settings.device, rank)
    if settings.num_threads or device.type == "cpu":
        torch.set_num_threads(worker_threads(settings.num_threads, settings.tp))
    tp = join_group(rank, settings.tp, init_method, device, settings.tp_timeout_s)
    try:
        runner, _ = build_runner(source, settings, incarnation, tp)
        if settings.kv_offload:  # this rank's heads of every chunk rank 0 moves
            from services.worker.kv_offload.wiring import build_follower

            runner.kv_connector = build_follower(
                settings, runner.kv_cache, runner.config, source, tp
            )
        follow(runner, pipe, tp)
    finally:
        leave_group()


def follow(runner: Any, pipe: Connection, tp: TensorParallel) -> None:
    """Make rank 0's runner calls until it says stop or goes away. A call that raises here
    raised on rank 0 too (the same plan, the same shapes), which answers it with an error and
    sends `reset`."""
    launched: collections.deque[Any] = collections.deque()
    while True:
        try:
            op, arg = pipe.recv()
        except (EOFError, OSError):
            log.info("rank 0 is gone: rank %d stops", tp.rank)
            return
        try:
            if op == "launch":
                launched.append(runner.launch(arg))
            elif op == "finish":
                runner.finish(launched.popleft())
            elif op == "execute":
                runner.execute(arg)
            elif op == "kv_load":  # rank 0 applies KV loads it read: our heads of them
                runner.kv_connector.apply_loads(arg)
            elif op == "reset":
                launched.clear()
                runner.reset()
            elif op == "stop":
                return
            else:
                raise ValueError(f"unknown runner call {op!r}")
        except Exception:
            log.exception("rank %d: %s failed", tp.rank, op)
