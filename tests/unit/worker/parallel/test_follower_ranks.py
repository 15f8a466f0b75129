"""FollowerRanks.dead: a follower's exit is seen however the process learns of it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from services.worker.parallel.ranks import Follower, FollowerRanks


def _ranks(count: int) -> FollowerRanks:
    context = mp.get_context("spawn")
    followers = []
    for rank in range(1, count + 1):
        ours, _theirs = context.Pipe()
        process = context.Process(target=time.sleep, args=(60,), daemon=True)
        process.start()
        followers.append(Follower(rank, process, ours))
    return FollowerRanks(followers)


def _until_dead(ranks: FollowerRanks) -> list[tuple[int, int | None]]:
    deadline = time.monotonic() + 10
    while not (dead := ranks.dead()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return dead


def test_a_killed_follower_is_dead_with_its_exit_code() -> None:
    ranks = _ranks(2)
    try:
        assert ranks.dead() == []
        os.kill(ranks.followers[1].process.pid, signal.SIGKILL)
        assert _until_dead(ranks) == [(2, -signal.SIGKILL)]
    finally:
        ranks.close(timeout_s=5)


def test_a_follower_reaped_by_someone_else_is_still_seen_dead() -> None:
    """A waitpid elsewhere in the process (a library, a child watcher) reaps the follower
    first: is_alive() then stays True, the sentinel still reports the exit."""
    ranks = _ranks(1)
    try:
        process = ranks.followers[0].process
        os.kill(process.pid, signal.SIGKILL)
        os.waitpid(process.pid, 0)
        assert process.is_alive()  # what the old check relied on
        assert _until_dead(ranks) == [(1, None)]
    finally:
        ranks.close(timeout_s=5)
