"""KV offload transfers between a worker's KV cache and the Redis tier (issue: KV offload tier).

The scheduler decides every transfer; the worker carries it out; the kvstore keeps the policy
state (which chunks exist, recency, pins). One offload CHUNK is one KV cache block of one group:
its Redis payload key (`shared.kv.offload_key`, model and layout version in the name)
holds every layer's K and V for that block, with a header (see the worker's payload layout).

- `StepPlan.kv_stores`: after this step's forward, the worker copies the listed blocks (their KV
  is complete: computed by this step or earlier, never an unverified draft position) into
  host staging memory BEFORE running any later step, then writes them to Redis from a
  background thread. The copy happens before the next plan's forward, so the scheduler may
  reuse the blocks from the next step on.
- `StepPlan.kv_loads`: the worker reads the listed chunks (host tier first, then Redis,
  pipelined) and copies them into the listed blocks, in the background. The scheduler does not
  schedule compute for a loading request until the load is reported done: the blocks are marked
  computed only then.
- `KVTransferDone`: one per transfer, on the worker's results stream, sent by the worker when the
  transfer finished (ok or not) — possibly several steps later, or between steps while the
  scheduler idles. A failed load makes the scheduler recompute the request from its last
  computed token and mark the keys as misses; a failed store is reported to the kvstore so the
  chunk is dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import Message, Struct, register
from shared.protocol.packed import PackedInt32


class KVTransfer(Struct):
    """Chunks of one request to move: `keys[i]` (Redis payload key) <-> block `block_ids[i]` of
    KV cache group `groups[i]`. Chunks are listed in position order (prefix head first)."""

    transfer_id: str
    request_id: str
    keys: list[str]
    groups: PackedInt32
    block_ids: PackedInt32


@register
class KVTransferDone(Message):
    TYPE = "kv_transfer_done"
    VERSION = 1

    worker_id: str
    worker_incarnation: str = ""
    transfer_id: str
    request_id: str
    kind: Literal["load", "store"]
    ok: bool
    failed_keys: list[str] = Field(default_factory=list)  # chunks that could not be moved
    num_bytes: int = Field(0, ge=0)
    seconds: float = Field(0.0, ge=0.0)
    error: str | None = None
