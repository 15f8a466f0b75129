"""Recording synchronizing CUDA calls: a runner call wrapped so that every call in it that
waits for the GPU (torch.cuda.set_sync_debug_mode("warn")) is listed as "file:line" of the
project's own code (tests/gpu/test_no_host_sync_cuda.py, tests/gpu/test_spec_cuda.py)."""

from __future__ import annotations

import threading
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Launch = Callable[[Any], object]

ROOT = Path(__file__).resolve().parents[2]
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's message in "warn" mode


def _call_site(filename: str, lineno: int) -> str:
    """The innermost frame of the project's own code (not tests/) on the current stack, else
    the warning's own frame with the stack under it."""
    stack = [f for f in traceback.extract_stack() if not f.filename.startswith("<")]
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ROOT) and not path.is_relative_to(ROOT / "tests"):
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    under = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(stack[-12:]))
    return f"{Path(filename).name}:{lineno} ({threading.current_thread().name}: {under})"


def guarded(launch: Launch, sites: list[str]) -> Launch:
    """`launch` with every synchronizing CUDA call in it recorded as "file:line"."""

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
        if SYNC_WARNING in str(message):
            sites.append(_call_site(filename, lineno))

    def run(plan: Any) -> object:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")  # (it warns that it is on: not recorded)
            warnings.showwarning = record
            try:
                return launch(plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    return run
