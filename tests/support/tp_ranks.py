"""Run a function on every rank of a real CPU tensor-parallel group (gloo), one spawned
process per rank, and collect what each rank returns.

`target(tp, *args)` runs on each rank after it joined the group; its return value (picklable)
comes back indexed by rank. A rank that raises fails the whole run with its traceback. Each rank
runs torch with one thread: the test machines have few cores.
"""

from __future__ import annotations

import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from services.worker.parallel.group import TensorParallel, join_group, leave_group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    size: int,
    init_method: str,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        tp = join_group(rank, size, init_method, torch.device("cpu"), timeout_s=120)
        try:
            results.put((rank, True, target(tp, *args)))
        finally:
            leave_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    target: Callable[..., Any], size: int, *args: Any, timeout_s: float = 600
) -> list[Any]:
    """[what rank 0 returned, what rank 1 returned, ...]."""
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        context.Process(
            target=_rank_main, args=(target, rank, size, init_method, args, results), daemon=True
        )
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(size):
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue_module.Empty:
                missing = sorted(set(range(size)) - set(out))
                raise TimeoutError(f"ranks {missing} never answered") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return [out[rank] for rank in range(size)]


def single(target: Callable[..., Any], *args: Any) -> Any:
    """`target` as the one rank of a group of size 1 (in this process)."""
    return target(TensorParallel(), *args)
