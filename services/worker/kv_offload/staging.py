"""Host staging for KV offload: preallocated slots for stores, and the two block copies.

Stores (device -> host) must leave the KV cache before the next plan runs, because from then on
the scheduler may hand the blocks to another request; serialising and writing to Redis can take
far longer than a step. So the step thread only copies the blocks into a staging slot (on CUDA:
an asynchronous copy into pinned memory, fenced by an event; on CPU a plain tensor copy), and
the store thread serialises from the slot once the fence has passed, then gives the slot back.
The slots are allocated once (pinned allocation is slow and fragments) and reused. A store
larger than the free slots is staged in pieces (`store_job`): the step thread waits for slots,
which the store side frees as soon as it has copied a piece's bytes out (memcpy, not Redis), so
a slow Redis never stalls a step; only a wait past a deadline refuses the rest of a store.

Loads (host -> device) go through the one staged-pinned copy helper
(`kernels.runtime.staged_copy.stage_to_device`) on the load thread, and `scatter_blocks` then copies
the uploaded chunks into their blocks on the step thread, ordered on the same stream. (With
the cache on the CPU there is no device: the assembled host tensor is scattered directly.)
"""

from __future__ import annotations

import threading

import torch

from kernels.runtime.staged_copy import CopyFence

ChunkShape = tuple[int, int, int, int, int]  # [layers, 2, block_size, kv_heads, head_dim]


class StagingPool:
    """`num_slots` host tensors of one chunk each, handed out all-or-nothing.

    Invariant: a slot is owned by at most one store job between `acquire` and `release`.
    """

    def __init__(
        self, chunk_shape: ChunkShape, dtype: torch.dtype, num_slots: int, pinned: bool
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.chunk_shape = chunk_shape
        self.buffer = torch.empty((num_slots, *chunk_shape), dtype=dtype, pin_memory=pinned)
        self._free = list(range(num_slots))
        self._lock = threading.Condition()

    @classmethod
    def sized(
        cls, chunk_shape: ChunkShape, dtype: torch.dtype, budget_bytes: int, pinned: bool
    ) -> StagingPool:
        """As many slots as `budget_bytes` holds, at least one."""
        numel = 1
        for dim in chunk_shape:
            numel *= dim
        chunk_bytes = numel * torch.empty((), dtype=dtype).element_size()
        return cls(chunk_shape, dtype, max(1, budget_bytes // chunk_bytes), pinned)

    @property
    def num_slots(self) -> int:
        return int(self.buffer.shape[0])

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, n: int) -> list[int] | None:
        """`n` free slots, or None (nothing taken) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def acquire_wait(self, n: int, timeout_s: float) -> list[int] | None:
        """`n` free slots, waiting up to `timeout_s` for releases; None (nothing taken) when
        they did not come or `n` exceeds the pool."""
        with self._lock:
            if n > self.num_slots or not self._lock.wait_for(
                lambda: len(self._free) >= n, timeout_s
            ):
                return None
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)
            self._lock.notify_all()


def _fence(device: torch.device) -> CopyFence | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def gather_blocks(
    layers: list[torch.Tensor], block_ids: list[int], pool: StagingPool, slots: list[int]
) -> CopyFence | None:
    """Copy block `block_ids[j]` of every layer in `layers` into slot `slots[j]`, laid out as
    a payload body [layers, 2, block_size, kv_heads, head_dim]. Returns the fence the reader of
    the slots must wait for (None when the copy is already complete, i.e. on CPU)."""
    device = layers[0].device
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
    if device.type == "cpu":
        index = torch.tensor(slots, dtype=torch.int64)
        for i, layer in enumerate(layers):
            pool.buffer[index, i] = layer[:, blocks].transpose(0, 1)
        return None
    # On the device: gather into one contiguous tensor, then one DMA per chunk into pinned slots.
    gathered = torch.stack([layer[:, blocks].transpose(0, 1) for layer in layers], dim=1)
    for j, slot in enumerate(slots):
        pool.buffer[slot].copy_(gathered[j], non_blocking=True)
    return _fence(device)


def scatter_blocks(layers: list[torch.Tensor], block_ids: list[int], chunks: torch.Tensor) -> None:
    """Write `chunks` [n, layers, 2, block_size, kv_heads, head_dim] (on the cache's device)
    into blocks `block_ids` of `layers`: the inverse of `gather_blocks`."""
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=chunks.device)
    for i, layer in enumerate(layers):
        layer.index_copy_(1, blocks, chunks[:, i].transpose(0, 1))
