"""Host staging for KV offload: preallocated payload slots for stores, and the two block copies.

Stores (device -> host) must leave the KV cache before the next plan runs, because from then on
the scheduler may hand the blocks to another request; writing to Redis can take far longer than
a step. So the step thread only copies the blocks into staging slots (on CUDA: an asynchronous
copy into pinned memory, fenced by an event; on CPU a plain tensor copy), and the store thread
sends each slot to Redis once the fence has passed, then gives the slot back.

A slot holds a chunk's whole payload (services/worker/kv_offload/payload.py): its header, written
once when the pool is made (every chunk of a group has the same header), then its body, which
`gather_blocks` fills in the model's dtype. The store thread sends the slot's bytes straight
from this memory (a memoryview: no serialising, no copy on the way to the socket), so a store
costs one copy out of the cache and nothing else in this process. The body starts on an aligned
address (the header is preceded by padding), so the typed view of it is a plain tensor view.

The slots are allocated once (pinned allocation is slow and fragments) and reused. They bound
the store path: a store that finds too few free slots stages its head chunks and drops the rest
(the step never waits for slots, and so never for Redis).

Loads (host -> device) go through the one staged-pinned copy helper
(`meshllm_kernels.runtime.staged_copy.stage_to_device`) on the load thread, and `scatter_blocks`
then writes the uploaded chunks into their blocks on the step thread, ordered on the same stream,
through the write path of context-only KV (services/worker/attention/context_kv.py: the KV-only
insert kernel on CUDA). (With the cache on the CPU there is no device: the assembled host tensor
is written directly.)
"""

from __future__ import annotations

import threading

import torch

from meshllm_kernels.runtime.staged_copy import CopyFence
from services.worker.attention.context_kv import ContextKVWriter
from services.worker.kv_offload.payload import PayloadHeader

ALIGN = 64  # bytes: where each slot and each body starts


class StagingPool:
    """`num_slots` payload slots of one KV cache group, handed out at most as many as are free.

    Invariant: a slot is owned by at most one store between `acquire` and `release`, and its
    header bytes never change.
    """

    def __init__(self, header: PayloadHeader, num_slots: int, pinned: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.header = header
        encoded = header.encode()
        pad = -len(encoded) % ALIGN
        body_start = pad + len(encoded)
        self._payload = slice(pad, body_start + header.body_bytes)
        slot_bytes = -(-self._payload.stop // ALIGN) * ALIGN
        self.buffer = torch.zeros((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pinned)
        self.buffer[:, pad:body_start] = torch.tensor(list(encoded), dtype=torch.uint8)
        body = self.buffer[:, body_start : body_start + header.body_bytes]
        # [slots, layers, 2, block_size, kv_heads, head_dim]: a view into the slots' bodies.
        self.bodies = body.view(header.dtype).view(num_slots, *header.shape)
        self._free = list(range(num_slots))
        self._lock = threading.Lock()

    @classmethod
    def sized(cls, header: PayloadHeader, budget_bytes: int, pinned: bool) -> StagingPool:
        """As many slots as `budget_bytes` holds, at least one."""
        slot_bytes = len(header.encode()) + header.body_bytes + ALIGN
        return cls(header, max(1, budget_bytes // slot_bytes), pinned)

    @property
    def num_slots(self) -> int:
        return int(self.buffer.shape[0])

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def payload_bytes(self) -> int:
        return self._payload.stop - self._payload.start

    def acquire(self, n: int) -> list[int]:
        """Up to `n` free slots (fewer, or none, when fewer are free); never waits."""
        with self._lock:
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def payload(self, slot: int) -> memoryview:
        """The slot's payload bytes (header + body), for the writer to send as they are."""
        return memoryview(self.buffer[slot].numpy())[self._payload]


def _fence(device: torch.device) -> CopyFence | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def gather_blocks(
    layers: list[torch.Tensor], block_ids: list[int], pool: StagingPool, slots: list[int]
) -> CopyFence | None:
    """Copy block `block_ids[j]` of every layer in `layers` into the body of slot `slots[j]`,
    laid out as [layers, 2, block_size, kv_heads, head_dim]. Returns the fence the reader of the
    slots must wait for (None when the copy is already complete, i.e. on CPU)."""
    device = layers[0].device
    if device.type == "cpu":
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        index = torch.tensor(slots, dtype=torch.int64)
        for i, layer in enumerate(layers):
            pool.bodies[index, i] = layer[:, blocks].transpose(0, 1)
        return None
    # On the device: gather into one contiguous tensor, then one DMA per chunk into pinned slots.
    return stage_chunks(take_blocks(layers, block_ids), pool, slots)


def take_blocks(layers: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """Blocks `block_ids` of `layers` as chunks [n, layers, 2, block_size, kv_heads, head_dim]
    (a copy, on the cache's device)."""
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=layers[0].device)
    return torch.stack([layer[:, blocks].transpose(0, 1) for layer in layers], dim=1)


def stage_chunks(chunks: torch.Tensor, pool: StagingPool, slots: list[int]) -> CopyFence | None:
    """Copy `chunks[j]` (payload bodies, on the cache's device) into the body of slot
    `slots[j]`; returns the fence as `gather_blocks` does."""
    if chunks.device.type == "cpu":
        pool.bodies[torch.tensor(slots, dtype=torch.int64)] = chunks[: len(slots)]
        return None
    for j, slot in enumerate(slots):
        pool.bodies[slot].copy_(chunks[j], non_blocking=True)
    return _fence(chunks.device)


def scatter_blocks(
    layers: list[torch.Tensor], block_ids: list[int], chunks: torch.Tensor, write: ContextKVWriter
) -> None:
    """Write `chunks` [n, layers, 2, block_size, kv_heads, head_dim] (on the cache's device)
    into blocks `block_ids` of `layers`: the inverse of `gather_blocks`, one `write` per layer
    of the chunks' n * block_size token rows at their slots."""
    n, num_layers, _, block_size, kv_heads, head_dim = chunks.shape
    device = chunks.device
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=device)).view(-1)
    # [layers, 2, n * block_size, kv_heads, head_dim]: a view of one chunk, one copy of several.
    rows = chunks.permute(1, 2, 0, 3, 4, 5).reshape(
        num_layers, 2, n * block_size, kv_heads, head_dim
    )
    for i, layer in enumerate(layers):
        write(layer, rows[i, 0], rows[i, 1], slots)
