"""One store transfer as it moves through the worker: staged in pieces, answered once.

Staging is bounded and the step thread never waits for it: a store stages as many of its
chunks (head first, per KV cache group) as there are free slots, one `StorePiece` per group,
and drops the rest (`reject`: a suffix is worthless without its head, a head without its suffix
is still a hit). The writer thread SETs each piece's payloads straight from its slots and then
gives them back.

The transfer is answered exactly once (one KVTransferDone), when it is `seal`ed (every piece
submitted) and every piece's fate is known (written, failed, or dropped at shutdown), whichever
of those comes last: `seal` and `piece_done` return True to exactly one caller, who reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from meshllm_kernels.runtime.staged_copy import CopyFence
from shared.protocol import KVTransfer


@dataclass
class StoreJob:
    """The transfer-level state of a store: what its pieces did, accumulated."""

    transfer: KVTransfer
    started: float
    rejected_keys: list[str] = field(default_factory=list)  # chunks that were never staged
    rejected_reason: str | None = None
    failed_keys: list[str] = field(default_factory=list)  # staged, but not written
    written: int = 0  # payload bytes written
    error: str | None = None
    _outstanding: int = 0
    _sealed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reject(self, keys: list[str], reason: str) -> None:
        """Chunks the step thread could not stage (their transfer still ends normally)."""
        with self._lock:
            self.rejected_keys += keys
            self.rejected_reason = self.rejected_reason or reason

    def add_piece(self) -> None:
        with self._lock:
            assert not self._sealed, "a sealed store takes no more pieces"
            self._outstanding += 1

    def piece_done(self, failed: list[str], written: int, error: str | None) -> bool:
        """Account one piece; True when this completes a sealed job (the caller reports it)."""
        with self._lock:
            self.failed_keys += failed
            self.written += written
            self.error = self.error or error
            self._outstanding -= 1
            return self._sealed and self._outstanding == 0

    def seal(self) -> bool:
        """Every piece is submitted; True when none is outstanding (the caller reports it)."""
        with self._lock:
            self._sealed = True
            return self._outstanding == 0


@dataclass
class StorePiece:
    """Staged chunks of one store: `payloads[j]` (a staging slot's bytes) goes to `keys[j]`."""

    job: StoreJob
    keys: list[str]
    payloads: list[memoryview]
    fence: CopyFence | None
    release: Callable[[], None]  # gives the staging slots back

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.payloads)
