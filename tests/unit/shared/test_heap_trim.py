"""shared.heap_trim: freed heap that glibc holds goes back to the OS; the periodic task stops
with its service."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared import heap_trim

GLIBC = heap_trim._TRIM is not None

# 100 MB in 1 KB blocks (below glibc's mmap threshold: they live in the heap), all freed but
# the last, which pins the top of the heap so free() alone cannot shrink it.
HOLD_THEN_FREE = textwrap.dedent(
    """
    import ctypes, os, sys
    from shared.heap_trim import trim_heap
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * page
    blocks = [libc.malloc(1024) for _ in range(100_000)]
    for b in blocks:
        ctypes.memset(b, 1, 1024)
    for b in blocks[:-1]:
        libc.free(b)
    before = rss()
    released = trim_heap() if sys.argv[1] == "trim" else False
    print(before - rss(), released)
    """
)


def rss_drop(mode: str) -> tuple[int, bool]:
    env_path = str(Path(__file__).resolve().parents[3])
    out = subprocess.run(
        [sys.executable, "-c", HOLD_THEN_FREE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": env_path},
    ).stdout.split()
    return int(out[0]), out[1] == "True"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trim_returns_freed_heap_to_the_os() -> None:
    dropped, released = rss_drop("trim")
    assert released and dropped > 50 * 2**20, dropped
    kept, _ = rss_drop("none")  # the control: freed, not trimmed, still resident
    assert kept < 10 * 2**20, kept


async def test_the_periodic_trim_stops_with_its_service() -> None:
    closed = asyncio.Event()
    task = asyncio.create_task(heap_trim.trim_heap_every(0.01, closed))
    await asyncio.sleep(0.05)
    assert not task.done()
    closed.set()
    await asyncio.wait_for(task, 1)
    # 0 = never: returns at once
    await asyncio.wait_for(heap_trim.trim_heap_every(0, asyncio.Event()), 1)
