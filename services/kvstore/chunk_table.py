"""Which offload chunks exist, how big they are, and who holds them.

A chunk's reference count is its whole status (CONTRACTS.md, background vocabulary):
- `WRITING` (-1): its payload is being written; readers must not use it, eviction must not
  delete it (the writer would recreate a payload nobody tracks);
- 0: ready and evictable;
- n > 0: ready and pinned by n in-flight reads; never evicted under a reader.

Invariants kept by every method: `used_bytes` is the sum of the sizes of all chunks (writing
ones included: their bytes are already reserved), and `evictable_count` is the number of chunks
with refs == 0. Recency is NOT here: it belongs to the policy, so pinning never changes it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from enum import Enum

WRITING = -1

Key = Hashable
"""An offload chunk's identity. The kvstore uses payload key names (model-scoped); tests and
the scheduler side use `OffloadKey`. The table and the policies only hash and compare keys."""


class ChunkStatus(Enum):
    WRITING = "writing"
    READY = "ready"
    PINNED = "pinned"


@dataclass(slots=True)
class Chunk:
    nbytes: int
    refs: int = WRITING

    @property
    def status(self) -> ChunkStatus:
        if self.refs == WRITING:
            return ChunkStatus.WRITING
        return ChunkStatus.READY if self.refs == 0 else ChunkStatus.PINNED


class ChunkTable:
    """The status and size of every chunk the offload tier holds."""

    def __init__(self) -> None:
        self._chunks: dict[Key, Chunk] = {}
        self.used_bytes = 0
        self.evictable_count = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: object) -> bool:
        return key in self._chunks

    def __iter__(self) -> Iterator[Key]:
        return iter(self._chunks)

    def get(self, key: Key) -> Chunk | None:
        return self._chunks.get(key)

    def status(self, key: Key) -> ChunkStatus | None:
        chunk = self._chunks.get(key)
        return None if chunk is None else chunk.status

    def is_evictable(self, key: Key) -> bool:
        chunk = self._chunks.get(key)
        return chunk is not None and chunk.refs == 0

    def nbytes(self, key: Key) -> int:
        return self._chunks[key].nbytes

    def add(self, key: Key, nbytes: int, *, ready: bool = False) -> None:
        if key in self._chunks:
            raise KeyError(f"chunk {key!r} already exists")
        if nbytes < 0:
            raise ValueError(f"chunk size must be >= 0, got {nbytes}")
        self._chunks[key] = Chunk(nbytes, 0 if ready else WRITING)
        self.used_bytes += nbytes
        if ready:
            self.evictable_count += 1

    def mark_ready(self, key: Key) -> bool:
        """WRITING -> ready (0). False when the chunk is absent or was not being written."""
        chunk = self._chunks.get(key)
        if chunk is None or chunk.refs != WRITING:
            return False
        chunk.refs = 0
        self.evictable_count += 1
        return True

    def pin(self, key: Key) -> bool:
        """One more reader. Only ready chunks can be read; False otherwise (nothing changes)."""
        chunk = self._chunks.get(key)
        if chunk is None or chunk.refs == WRITING:
            return False
        if chunk.refs == 0:
            self.evictable_count -= 1
        chunk.refs += 1
        return True

    def unpin(self, key: Key) -> bool:
        """One reader fewer. True when the chunk became evictable again."""
        chunk = self._chunks.get(key)
        if chunk is None or chunk.refs <= 0:
            raise KeyError(f"chunk {key!r} is not pinned")
        chunk.refs -= 1
        if chunk.refs == 0:
            self.evictable_count += 1
            return True
        return False

    def remove(self, key: Key) -> Chunk:
        chunk = self._chunks.pop(key)
        self.used_bytes -= chunk.nbytes
        if chunk.refs == 0:
            self.evictable_count -= 1
        return chunk

    def counts(self) -> dict[str, int]:
        by_status = {s.value: 0 for s in ChunkStatus}
        for chunk in self._chunks.values():
            by_status[chunk.status.value] += 1
        return {"chunks": len(self._chunks), "used_bytes": self.used_bytes, **by_status}
