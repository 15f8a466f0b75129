"""Triton kernels compiled in a pool of threads: a CUDA worker's warm-up, minutes to seconds.

A worker compiles every kernel specialization a serving step can meet before it serves
(attention/decode_variants.py, attention/prefill_variants.py): on a fresh H100 at the
Llama-3-8B shape that is 44 decode-attention choices at two table widths and the paged prefill,
117 s of a 142 s start when compiled one after another as they are launched. Triton's compile
releases the GIL for most of its work (MLIR passes, LLVM, ptxas), and it can compile in an
executor (`triton.runtime._async_compile.AsyncCompileMode`): a kernel launched inside that mode
returns a future instead of waiting, if it is only compiled and not run (`warmup=True`).

`compiles_in_parallel(threads)` is that: inside it every Triton launch compiles its kernel in
the pool and runs nothing; leaving it waits for every compile and puts each kernel in its
function's cache, so the launches after it find their kernels compiled. `precompiled(launch)`
runs the warm-up's launches once inside (compile only) and once after (the real launches,
which check them).

Nothing inside may read a launched kernel's output: nothing runs. The switch is the JIT's, for
the whole process: use it only while no other thread launches Triton kernels (the worker's
warm-up, before it serves). Without the mode (a Triton without it) or with one thread it
compiles nothing itself, and the launches after it compile one by one as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The pool's size by default: the CPUs this process may use, at most this many.
MAX_THREADS = 16


def default_threads() -> int:
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


@contextmanager
def compiles_in_parallel(threads: int | None = None) -> Iterator[bool]:
    """Inside: Triton launches compile in `threads` threads (default_threads()) and do not run.
    Yields whether the pool is in use (False: launches inside run as usual)."""
    threads = default_threads() if threads is None else threads
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except ImportError:  # a Triton without the mode: compiled one by one, as launched
        log.info("this Triton has no AsyncCompileMode: kernels compile one by one")
        threads = 1
    if threads <= 1:
        yield False
        return
    run = JITFunction.run

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    # Left in reverse: the mode waits for every compile, then the pool shuts down.
    pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile")
    with pool, AsyncCompileMode(pool):
        JITFunction.run = compile_only  # type: ignore[method-assign]
        try:
            yield True
        finally:
            JITFunction.run = run  # type: ignore[method-assign]


def precompiled(launch: Callable[[], T], threads: int | None = None) -> tuple[T, bool]:
    """Run `launch` (a function of Triton launches) once inside the pool, where it only
    compiles, then for real; (what the real run returned, whether the pool was used)."""
    with compiles_in_parallel(threads) as pooled:
        if pooled:
            launch()
    return launch(), pooled
