"""Give freed heap back to the OS, periodically.

glibc keeps memory that Python and native libraries free in its arenas for reuse; a long-running
service whose allocations come and go in bursts (a batch of requests, a tokenizer call on a big
body, a large step) ends up holding the high-water mark. Measured on the CPU soak
(bench/RESULTS.md): the worker's and scheduler's Python heaps stayed flat while their RSS grew,
and `malloc_trim(0)` returned 100-220 MB per service. Every service calls it every
`MESHLLM_MALLOC_TRIM_INTERVAL_S` (0 = never), off the event loop. Not glibc (musl, macOS): a
no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def _load_trim() -> Callable[[int], int] | None:
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    return None


_TRIM = _load_trim()


def trim_heap() -> bool:
    """Release free heap at the top and free whole pages inside the arenas; True if any
    memory went back to the OS."""
    return bool(_TRIM(0)) if _TRIM is not None else False


async def trim_heap_every(interval_s: float, closed: asyncio.Event) -> None:
    """Until `closed` is set: `trim_heap` every `interval_s` seconds (never when <= 0)."""
    if interval_s <= 0 or _TRIM is None:
        return
    while not closed.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closed.wait(), interval_s)
            return
        await asyncio.to_thread(trim_heap)
