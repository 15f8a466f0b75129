"""The one OS thread that runs the worker's model code.

torch's CPU kernels parallelise with OpenMP, and an OpenMP runtime keeps one team of threads
per calling OS thread. `asyncio.to_thread` hands successive calls to whichever thread of the
default executor is free, so consecutive steps ran on different threads, each with its own team
of `num_threads` spinning workers: on a 2-core machine two teams fought over the cores and
every step slowed down. Every forward, warmup and KV copy of the
worker goes through this single thread instead, so one team serves them all (and CUDA work is
issued from one thread, in order).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class StepThread:
    def __init__(self, name: str = "step") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run `fn(*args, **kwargs)` on the step thread; calls run in submission order."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
