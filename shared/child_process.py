"""Child processes that die with their parent.

A process a service starts for itself (the gateway's planning processes, a tensor-parallel
worker's follower ranks) must not outlive the service: killed with SIGKILL, the service cannot
stop them, and they would linger holding memory (a planning process holds a tokenizer, ~110 MB)
or a collective. Linux's PR_SET_PDEATHSIG has the kernel send SIGKILL to the child when the
thread that started it exits; the services start their children from their main thread, so that
is the process's exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Call first thing in the child. `parent_pid`: the parent's pid as the parent saw it; if
    the parent is already gone (exited before this ran), the child exits now."""
    # Not Linux (no libc.so.6): nothing to set; the caller's other checks (closed pipes,
    # timeouts) still end the child.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
